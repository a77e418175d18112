"""The per-sequence KV cache of continuous batching (engines/paged.py): which models run on it, that a
row holds blocks for its own positions only (no padding for the others), gives them back when it
leaves, and that joining still decodes each request to its tokens alone, for every causal family."""

from __future__ import annotations

import pytest

from _engine_helpers import build_artifact, make_checkpoint, run_tp_ranks

PROMPTS = ["the quick brown fox jumps over the lazy dog and then some more words follow", "a",
           "hello world hello world", "one two three four five six seven eight nine ten eleven"]
LENGTHS = [37, 5, 20, 12]
JOINS = {0: [0], 2: [1, 2], 9: [3]}  # step: the requests that join before it


def _engine(artifact, family: str):
    from lmc.runtime.engines.hf import HFEngine

    engine = HFEngine(family=family, task="text-generation", dtype="fp32", tensor_parallel_degree=1,
                      max_sequence_length=128, batch_size=8, device="cpu")
    engine.load(artifact, 0, 1)
    return engine


def _requests():
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    return [GenerationRequest(id=f"r{i}", prompt=prompt, params=GenerationParams(max_new_tokens=n, ignore_eos=True))
            for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS))]


def _joined(engine, on_step=None, block_size: int | None = None) -> dict[str, list[int]]:
    import torch

    requests = _requests()
    batch = engine.running_batch(None, block_size)
    finished, step = {}, 0
    with torch.inference_mode():
        while step <= max(JOINS) or len(batch):
            if step in JOINS:
                batch.join([requests[i] for i in JOINS[step]])
            for row in batch.step():
                finished[row.request.id] = list(row.generated)
            if on_step is not None:
                on_step(batch)
            step += 1
    return finished


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    built = {}
    for family in ("llama", "mistral", "qwen2", "mixtral", "gptj", "gpt_neox", "opt", "bloom"):
        built[family] = build_artifact(make_checkpoint(family, root / family / "ckpt"), root / family / "tp1", 1)
    return built


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "mixtral", "gptj", "gpt_neox", "opt", "bloom"])
def test_joining_gives_the_tokens_of_running_alone_in_every_causal_family(artifacts, family):
    engine = _engine(artifacts[family], family)
    alone = {request.id: engine.generate([request])[0].token_ids for request in _requests()}
    assert _joined(engine) == alone
    # Every causal family runs on the paged cache: those whose attention goes through transformers'
    # AttentionInterface, and GPT-J and BLOOM (their own attention code, which lmc routes).
    assert engine.loop.paged is True
    # Switched to lmc_paged, the model still serves dynamic batches (left-padded, SDPA's mask) as before.
    assert {request.id: result.token_ids for request, result in zip(_requests(), engine.generate(_requests()))} == alone


@pytest.mark.parametrize("block_size", [16, 8])  # the default, and a plan's kv_cache.block_size of 8
def test_a_row_holds_blocks_for_its_own_positions_only_and_gives_them_back(artifacts, block_size):
    engine = _engine(artifacts["llama"], "llama")
    seen = []

    def check(batch) -> None:
        if batch.state is None:
            seen.append((0, batch.cache.used() if batch.cache is not None else 0, 0))
            return
        lengths = batch.state.rows.lengths
        # After a step each row holds its prompt and every token chosen so far (the last one fed in that
        # step), in just the blocks those positions need: nothing for the other rows' lengths.
        assert lengths == [len(row.prompt_ids) + len(row.generated) for row in batch.rows]
        held = [len(blocks) for blocks in batch.state.rows.blocks]
        assert held == [-(-length // block_size) for length in lengths]
        pending = sum(len(blocks) for _, state in batch.pending if state is not None for blocks in state.rows.blocks)
        seen.append((len(lengths), batch.cache.used(), sum(held) + pending))
        assert batch.kv_blocks() == batch.cache.used()  # what the worker reports to /metrics

    _joined(engine, check, block_size)
    assert all(used == held for _, used, held in seen)  # the pool lends out exactly what the rows hold
    assert max(rows for rows, _, _ in seen) >= 3
    assert seen[-1][1] == 0  # every block back once the rows have left


def _tp2_rank(rank: int, opened: list[str], artifact: str, family: str) -> dict:
    from lmc.runtime.engines.hf import HFEngine

    engine = HFEngine(family=family, task="text-generation", dtype="fp32", tensor_parallel_degree=2,
                      max_sequence_length=128, batch_size=8, device="cpu")
    engine.load(artifact, rank, 2)
    return {"alone": {request.id: engine.generate([request])[0].token_ids for request in _requests()},
            "joined": _joined(engine), "paged": engine.loop.paged}


@pytest.mark.parametrize("family", ["gptj", "bloom"])  # their own attention code, routed to the paged layout
def test_tp2_joins_on_the_paged_cache_with_the_tp1_answers(artifacts, tmp_path, family):
    checkpoint = artifacts[family].parent / "ckpt"
    tp1 = _engine(artifacts[family], family)
    reference = {request.id: tp1.generate([request])[0].token_ids for request in _requests()}
    reports = run_tp_ranks(_tp2_rank, str(build_artifact(checkpoint, tmp_path / "tp2", 2)), family)
    for rank in (0, 1):  # each rank's half of every layer's heads (BLOOM: and their ALiBi slopes), its own pool
        assert reports[rank]["paged"] and reports[rank]["joined"] == reports[rank]["alone"] == reference, rank


def test_a_model_that_does_not_qualify_joins_on_the_shared_padded_cache(artifacts):
    engine = _engine(artifacts["llama"], "llama")
    alone = {request.id: engine.generate([request])[0].token_ids for request in _requests()}
    engine.loop.paged = False  # what paged.enable answers for a model it cannot switch: one left-padded cache
    seen = []

    def check(batch) -> None:
        width = batch.kv_tokens()
        assert batch.cache is None and batch.kv_blocks() == -(-len(batch.rows) * width // 16)
        seen.append((len(batch.rows), width, batch.kv_blocks()))

    assert _joined(engine, check) == alone
    assert any(rows >= 3 for rows, _, _ in seen) and seen[-1] == (0, 0, 0)  # several rows at once; none at the end


def test_the_pool_grows_when_the_rows_need_more_blocks(artifacts, monkeypatch):
    from lmc.runtime.engines import paged

    engine = _engine(artifacts["llama"], "llama")
    alone = {request.id: engine.generate([request])[0].token_ids for request in _requests()}
    monkeypatch.setattr(paged, "_FIRST_BLOCKS", 2)
    capacities = []
    assert _joined(engine, lambda batch: capacities.append(batch.cache.capacity)) == alone
    assert max(capacities) > 2  # it started at 2 blocks and grew, the rows' tokens untouched


@pytest.mark.parametrize("family, window_config", [
    ("mistral", {"sliding_window": 6}),
    # Qwen2: layer 0 attends in full, layer 1 in a window (max_window_layers): both kinds in one model.
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
])
def test_sliding_window_layers_join_and_keep_their_window(tmp_path, family, window_config):
    windowed = _engine(build_artifact(make_checkpoint(family, tmp_path / "w" / "ckpt", **window_config),
                                      tmp_path / "w" / "tp1", 1), family)
    full = _engine(build_artifact(make_checkpoint(family, tmp_path / "f" / "ckpt"), tmp_path / "f" / "tp1", 1), family)
    alone = {request.id: windowed.generate([request])[0].token_ids for request in _requests()}
    # The window matters here (prompts and answers run past 6 positions): same weights, other tokens.
    assert alone != {request.id: full.generate([request])[0].token_ids for request in _requests()}
    assert _joined(windowed) == alone
    assert windowed.loop.paged


def test_a_packed_prefill_attends_each_row_to_its_own_keys_only():
    import torch

    from lmc.runtime.engines.paged import PagedCache, Rows

    rows = Rows(PagedCache())
    rows.add([5, 20, 3])
    # A second chunk: row 0 is done, row 1 runs positions 16..19 (a chunk of 4 after 16), row 2 is done.
    rows.prefill_layout([(0, 5), (0, 16), (0, 3)], torch.device("cpu"))
    packed = rows.prefill_layout([(5, 5), (16, 20), (3, 3)], torch.device("cpu"))
    assert [(seg.q1 - seg.q0, seg.k1 - seg.k0) for seg in packed.segments] == [(4, 20)]  # no work for the others
    assert packed.segments[0].visible.mask.tolist() == [[k <= q for k in range(20)] for q in range(16, 20)]
    # Row 1's 20 positions span two blocks of its own; none of them is another row's.
    assert len(packed.read) == 20 and set(packed.read.tolist()) <= {
        block * 16 + i for block in rows.blocks[1] for i in range(16)}
    assert rows.lengths == [5, 20, 3]
