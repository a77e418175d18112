"""Continuous batching in the decode loop (generate.RunningBatch): a request decodes to the same tokens
(greedy) whether it ran alone or joined a running batch mid-way, at TP 1 and at TP 2 over gloo; rows
leave as they finish and the cache keeps no column only finished rows needed."""

from __future__ import annotations

import pytest

from _engine_helpers import build_artifact, make_checkpoint, run_tp_ranks

PROMPTS = ["the quick brown fox jumps over", "a", "hello world hello world hello world again and again",
           "one two three", "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod"]
LENGTHS = [40, 9, 17, 30, 12]
# (step at which it joins, prompt index): joins while others decode, two at once, one when others have left.
JOINS = [(0, 0), (3, 1), (3, 2), (7, 3), (28, 4)]


def _engine(artifact, rank: int = 0, world_size: int = 1):
    from lmc.runtime.engines.hf import HFEngine

    engine = HFEngine(family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=world_size,
                      max_sequence_length=256, batch_size=8, device="cpu")
    engine.load(artifact, rank, world_size)
    return engine


def _requests():
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    return [GenerationRequest(id=f"r{i}", prompt=prompt, params=GenerationParams(max_new_tokens=n))
            for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS))]


def _continuous(engine, chunk: int) -> dict:
    """Each request's tokens when they join a running batch at JOINS' steps; the cache width seen."""
    from lmc.runtime.engines import generate

    saved, generate.PREFILL_CHUNK_TOKENS = generate.PREFILL_CHUNK_TOKENS, chunk  # longer prompts: several steps
    try:
        return _joined(engine)
    finally:
        generate.PREFILL_CHUNK_TOKENS = saved


def _joined(engine) -> dict:
    import torch

    requests = _requests()
    batch = engine.running_batch()
    finished, widths, rows_seen, step = {}, [], [], 0
    with torch.inference_mode():
        while step <= JOINS[-1][0] or len(batch):
            for at, index in JOINS:
                if at == step:
                    batch.join([requests[index]])
            for row in batch.step():
                finished[row.request.id] = (list(row.generated), step)
            # The positions the cache holds for its longest row, and what the running rows need: each its
            # prompt and the tokens fed back so far.
            widths.append((batch.kv_tokens(), max((len(row.prompt_ids) + len(row.generated) for row in batch.rows),
                                                  default=0)))
            rows_seen.append(len(batch.rows))
            step += 1
    return {"tokens": {key: value[0] for key, value in finished.items()},
            "ended": {key: value[1] for key, value in finished.items()}, "widths": widths, "rows": rows_seen}


def _alone(engine) -> dict:
    return {request.id: engine.generate([request])[0].token_ids for request in _requests()}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("continuous")
    checkpoint = make_checkpoint("llama", root / "ckpt")
    return {1: build_artifact(checkpoint, root / "tp1", 1), 2: build_artifact(checkpoint, root / "tp2", 2)}


def test_joining_a_running_batch_gives_the_tokens_of_running_alone(artifacts):
    engine = _engine(artifacts[1])
    alone = _alone(engine)
    assert all(len(tokens) == n for tokens, n in zip(alone.values(), LENGTHS))  # no early EOS: a real comparison
    run = _continuous(engine, chunk=4)
    assert run["tokens"] == alone
    assert engine.loop.paged
    # r1 (9 tokens, joined at step 3 with a 3-chunk prompt) ends while r0 (40 tokens, from step 0) decodes.
    assert run["ended"]["r1"] < run["ended"]["r0"]
    assert max(run["rows"]) >= 3  # rows of different ages really decoded together


def test_the_cache_drops_columns_only_finished_rows_needed(artifacts):
    engine = _engine(artifacts[1])
    run = _continuous(engine, chunk=256)
    held, needed = zip(*run["widths"])
    # After every step the cache spans exactly what the running rows need: no column kept for a row that left.
    assert held == needed
    # ... and the width really falls at a departure (the longest row leaving while others run on).
    assert any(held[step] < held[step - 1] for step in run["ended"].values() if step > 0)


def _tp_rank(rank: int, opened: list[str], artifact: str) -> dict:
    engine = _engine(artifact, rank, 2)
    return {"alone": _alone(engine), "continuous": _continuous(engine, chunk=4)["tokens"], "paged": engine.loop.paged}


def test_tp2_joining_gives_the_tokens_of_tp1_alone_on_both_ranks(artifacts):
    reference = _alone(_engine(artifacts[1]))
    reports = run_tp_ranks(_tp_rank, str(artifacts[2]))
    for rank in (0, 1):
        assert reports[rank]["continuous"] == reports[rank]["alone"] == reference, rank
        assert reports[rank]["paged"], rank


def test_the_deepspeed_engine_on_cpu_batches_continuously_with_the_same_answers(artifacts):
    pytest.importorskip("deepspeed")
    from lmc.runtime.engines.deepspeed import DeepSpeedEngine

    engine = DeepSpeedEngine(family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=1,
                             max_sequence_length=256, batch_size=8, device="cpu")
    engine.load(artifacts[1], 0, 1)
    assert _continuous(engine, chunk=4)["tokens"] == _alone(_engine(artifacts[1]))
    assert engine.loop.paged  # its rows in the per-sequence cache, as with the hf engine


def test_a_step_hands_over_its_finished_rows_before_its_forward(artifacts):
    import torch

    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    engine = _engine(artifacts[1])
    log: list[str] = []
    model = getattr(engine.loop.model, "module", engine.loop.model)
    handle = model.register_forward_pre_hook(lambda module, args: log.append("forward"))
    batch = engine.running_batch()
    batch.join([GenerationRequest(id=f"r{i}", prompt=PROMPTS[i], params=GenerationParams(max_new_tokens=n, ignore_eos=True))
                for i, n in ((0, 3), (1, 6))])
    try:
        with torch.inference_mode():
            while len(batch):
                log.append("step")
                returned = batch.step(None, lambda rows: log.append("chosen " + ",".join(r.request.id for r in rows)))
                assert log[-1 if not len(batch) else -2].startswith("chosen")  # the last step runs no forward
                assert log[-1 if not len(batch) else -2] == "chosen " + ",".join(r.request.id for r in returned)
    finally:
        handle.remove()
    # r0's 3rd token is chosen in the step whose forward then runs r1 alone: its answer was handed over first.
    steps = " | ".join(" ".join(log).split("step ")[1:])
    assert "chosen r0 forward" in steps and steps.rstrip().endswith("chosen r1")
