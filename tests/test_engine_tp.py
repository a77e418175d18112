"""The hf engine at TP=2 over gloo: two processes, each reading only its own shard, greedy = HF generate."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

try:
    from _engine_helpers import (build_artifact, hf_greedy, hf_logits, logits_at_every_position, make_checkpoint,
                                 run_tp_ranks)
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import (build_artifact, hf_greedy, hf_logits, logits_at_every_position, make_checkpoint,
                                       run_tp_ranks)

PROMPTS = ["the quick brown", "héllo wörld, large models are served"]
# (case name, family, checkpoint overrides, config vocab size)
CASES = [
    ("llama", "llama", {}, 384),
    ("llama_mqa", "llama", {"num_key_value_heads": 1}, 384),  # TP 2 > 1 kv head: the kv head is replicated
    ("mistral", "mistral", {}, 384),
    ("qwen2", "qwen2", {}, 384),  # q/k/v biases split with their heads
    ("gpt_neox", "gpt_neox", {}, 384),
    ("opt", "opt", {}, 384),
    ("opt_odd_vocab", "opt", {}, 385),  # tied LM head that does not divide: whole on every rank
    ("gptj", "gptj", {}, 384),
    ("bloom", "bloom", {}, 384),
    ("t5", "t5", {}, 384),
]
NEW_TOKENS = (10, 4)  # per prompt: the second row leaves the run early (DecodeLoop.compact)
SAMPLED_TOKENS = 7


def _rank_main(rank: int, opened: list[str], artifacts: dict) -> dict:
    """One TP rank: load every case's artifact, generate, report tokens, opened shard files and shapes."""
    from lmc.runtime.engines import create_engine
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    out = {}
    for name, (family, artifact, dtype) in artifacts.items():
        task = "text2text-generation" if family == "t5" else "text-generation"
        engine = create_engine("hf", family=family, task=task, dtype=dtype, tensor_parallel_degree=2,
                               max_sequence_length=128, batch_size=4, device="cpu")
        del opened[:]
        engine.load(artifact, rank, 2)
        pieces, rows = [], []
        hook = engine.model.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(len(kwargs.get("input_ids", kwargs.get("decoder_input_ids")))),
            with_kwargs=True)
        results = engine.generate(
            [GenerationRequest(str(i), p, GenerationParams(max_new_tokens=n)) for i, (p, n) in
             enumerate(zip(PROMPTS, NEW_TOKENS))] + [GenerationRequest("s", PROMPTS[0], GenerationParams(
                max_new_tokens=SAMPLED_TOKENS, do_sample=True, temperature=2.0, seed=7))],
            on_token=lambda rid, piece: pieces.append(piece.text))
        hook.remove()
        params = sum(p.numel() for p in engine.model.parameters())
        out[name] = {"tokens": [r.token_ids for r in results], "opened": list(opened), "params": params,
                     "pieces": len(pieces), "rows": rows,
                     "finish": [r.finish_reason for r in results],
                     "logits": logits_at_every_position(engine.model, engine.tokenizer, family, PROMPTS[1]).tolist()}
    return out


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    checkpoints, artifacts = {}, {}
    for name, family, overrides, vocab in CASES:
        checkpoints[name] = make_checkpoint(family, root / name / "ckpt", vocab_size=vocab, **overrides)
        artifacts[name] = (family, str(build_artifact(checkpoints[name], root / name / "art", 2)), "fp32")
    # The build's own partitioner, int8: checks the runtime reads what the build writes.
    checkpoints["llama_int8"] = checkpoints["llama"]
    artifacts["llama_int8"] = ("llama", str(build_artifact(checkpoints["llama"], root / "int8", 2, "int8")), "int8")
    results = run_tp_ranks(_rank_main, artifacts)
    return checkpoints, artifacts, results


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_tp2_greedy_equals_hf_generate_on_the_whole_checkpoint(tp2_run, name):
    checkpoints, _, results = tp2_run
    reference = [hf_greedy(checkpoints[name], prompt, n) for prompt, n in zip(PROMPTS, NEW_TOKENS)]
    assert results[0][name]["tokens"][:2] == reference
    assert results[1][name]["tokens"] == results[0][name]["tokens"]  # sampling included: rank 0 decides


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_tp2_rows_leave_the_run_as_they_finish_on_both_ranks(tp2_run, name):
    """The model sees one row fewer from the step after a row finishes, on both ranks alike (the
    answers above stay HF's): the rows still decoding stop paying for finished ones."""
    _, _, results = tp2_run
    tokens, rows = results[0][name]["tokens"], results[0][name]["rows"]
    assert results[1][name]["rows"] == rows
    # A row is in the forwards that chose its tokens, and in the one that chose its end of sequence.
    forwards = [len(ids) + (finish == "eos") for ids, finish in zip(tokens, results[0][name]["finish"])]
    assert len(set(forwards)) > 1
    assert rows == [sum(n > step for n in forwards) for step in range(max(forwards))]


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_tp2_logits_equal_hf_on_the_whole_checkpoint_at_every_position(tp2_run, name):
    checkpoints, _, results = tp2_run
    family = dict((case[0], case[1]) for case in CASES)[name]
    reference = hf_logits(checkpoints[name], family, PROMPTS[1])
    for rank in range(2):
        logits = torch.tensor(results[rank][name]["logits"])  # a list: tensors would cross in shared memory
        assert logits.shape == reference.shape
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_each_rank_opens_only_its_own_shard(tp2_run, name):
    _, artifacts, results = tp2_run
    for rank in range(2):
        opened = results[rank][name]["opened"]
        assert opened == [os.path.join(artifacts[name][1], f"shards/tp2/rank{rank}.safetensors")]


def test_ranks_hold_about_half_the_weights(tp2_run):
    checkpoints, _, results = tp2_run
    from safetensors.torch import load_file

    whole = sum(t.numel() for t in load_file(checkpoints["llama"] / "model.safetensors").values())
    local = results[0]["llama"]["params"]
    assert whole * 0.4 < local < whole * 0.8  # embeddings and norms are replicated, the rest is halved


def test_only_rank0_streams(tp2_run):
    _, _, results = tp2_run
    assert results[0]["llama"]["pieces"] > 0
    assert results[1]["llama"]["pieces"] == 0


def test_int8_tp2_from_the_build_partitioner_equals_int8_at_tp1(tp2_run, tmp_path):
    """The ranks agree by construction (rank 0 picks the tokens): the check is against the same int8
    model served whole, so a rank that mishandles its slice of the per-row scales shows."""
    from lmc.runtime.engines import create_engine
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    checkpoints, _, results = tp2_run
    engine = create_engine("hf", family="llama", task="text-generation", dtype="int8", tensor_parallel_degree=1,
                           max_sequence_length=128, batch_size=4, device="cpu")
    engine.load(build_artifact(checkpoints["llama"], tmp_path / "int8-tp1", 1, "int8"), 0, 1)
    whole = engine.generate([GenerationRequest(str(i), p, GenerationParams(max_new_tokens=n))
                             for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))])
    assert results[0]["llama_int8"]["tokens"][:2] == [r.token_ids for r in whole]


def _failing_rank(rank: int, opened: list[str], artifact: str) -> dict:
    """Rank 0 fails to choose a token once: both ranks must fail that batch, then serve the next."""
    import lmc.runtime.engines.generate as generate
    from lmc.runtime.engines import create_engine
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    engine = create_engine("hf", family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=2,
                           max_sequence_length=128, batch_size=4, device="cpu")
    engine.load(artifact, rank, 2)
    original = generate.choose_token
    if rank == 0:
        def broken(*args, **kwargs):
            raise RuntimeError("probability tensor contains inf")
        generate.choose_token = broken
    request = [GenerationRequest("a", PROMPTS[0], GenerationParams(max_new_tokens=4))]
    try:
        engine.generate(request)
        first = "served"
    except RuntimeError as exc:
        first = str(exc)
    generate.choose_token = original
    return {"first": first, "then": engine.generate(request)[0].token_ids}


def test_a_token_choice_failing_on_rank_0_fails_every_rank_together(tp2_run):
    checkpoints, artifacts, _ = tp2_run
    results = run_tp_ranks(_failing_rank, artifacts["llama"][1], timeout_s=120)
    assert results[0]["first"] == "probability tensor contains inf"
    assert results[1]["first"] == "rank 0 could not choose the next tokens (see its log)"
    reference = hf_greedy(checkpoints["llama"], PROMPTS[0], 4)
    assert results[0]["then"] == results[1]["then"] == reference  # still in lockstep


def _cancelling_rank(rank: int, opened: list[str], artifact: str) -> dict:
    """Rank 0's cancel probe names request "x" from the start and "a" once it has streamed two pieces (their
    clients left): every rank leaves "x" out of the run and stops "a", "b" decodes on, and the next batch
    is served in lockstep."""
    from lmc.runtime.engines import create_engine
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    engine = create_engine("hf", family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=2,
                           max_sequence_length=128, batch_size=4, device="cpu")
    engine.load(artifact, rank, 2)
    pieces = {"a": 0, "b": 0}

    def on_token(request_id, piece):
        pieces[request_id] += 1

    def probe():
        return {"x", "a"} if pieces["a"] >= 2 else {"x"}

    batch = [GenerationRequest(rid, PROMPTS[0], GenerationParams(max_new_tokens=NEW_TOKENS[0], ignore_eos=True))
             for rid in ("a", "x", "b")]
    results = engine.generate(batch, on_token, cancel_probe=probe if rank == 0 else None)
    then = engine.generate([GenerationRequest("c", PROMPTS[1], GenerationParams(max_new_tokens=4))])[0].token_ids
    return {"results": [(r.finish_reason, r.generated_tokens, r.token_ids) for r in results], "then": then,
            "pieces": pieces}


def test_a_row_turned_down_on_rank_0_stops_on_every_rank(tp2_run):
    checkpoints, artifacts, _ = tp2_run
    results = run_tp_ranks(_cancelling_rank, artifacts["llama"][1], timeout_s=120)
    (a_reason, a_count, a_ids), x, (b_reason, b_count, b_ids) = results[0]["results"]
    assert (a_reason, b_reason) == ("cancelled", "length") and b_count == NEW_TOKENS[0]
    assert 2 <= a_count < NEW_TOKENS[0] and a_ids == b_ids[:a_count]  # the same greedy row, cut short
    assert x == ("cancelled", 0, [])  # never decoded
    assert results[1]["results"] == results[0]["results"]  # rank 1 learnt it from the broadcast
    assert results[1]["pieces"] == {"a": 0, "b": 0}  # (rank 1 streams nothing)
    assert results[0]["then"] == results[1]["then"] == hf_greedy(checkpoints["llama"], PROMPTS[1], 4)
