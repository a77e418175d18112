"""Mixtral (MoE) in the hf engine: hub expert shards fused like transformers does, TP=1 and TP=2 = HF generate."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

try:
    from _engine_helpers import build_artifact, hf_greedy, run_tp_ranks
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import build_artifact, hf_greedy, run_tp_ranks

from lmc.errors import ArtifactError
from lmc.runtime.engines import create_engine
from lmc.runtime.engines.base import GenerationParams, GenerationRequest
from lmc.testing.checkpoints import make_checkpoint

PROMPTS = ["the quick brown", "Hello, world! How are you today? The capital of"]
NEW_TOKENS = 10
# transformers' default init (0.02) makes the experts' share of the logits ~1e-2: greedy tokens would not
# notice gate and up swapped. At 0.2 the MoE output moves the logits by several units.
INIT = 0.2


def _engine(artifact, *, dtype="fp32"):
    engine = create_engine("hf", family="mixtral", task="text-generation", dtype=dtype, tensor_parallel_degree=1,
                           max_sequence_length=128, batch_size=4, device="cpu")
    engine.load(artifact, 0, 1)
    return engine


def _greedy(engine) -> list[list[int]]:
    requests = [GenerationRequest(str(i), p, GenerationParams(max_new_tokens=NEW_TOKENS)) for i, p in
                enumerate(PROMPTS)]
    return [r.token_ids for r in engine.generate(requests)]


def _hf_model(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    checkpoint = make_checkpoint("mixtral", root / "ckpt", seed=0, initializer_range=INIT)
    artifacts = {(tp, dtype): build_artifact(checkpoint, root / f"tp{tp}_{dtype}", tp, dtype)
                 for tp, dtype in [(1, "fp32"), (2, "fp32"), (1, "int8"), (2, "int8")]}
    reference = [hf_greedy(checkpoint, prompt, NEW_TOKENS) for prompt in PROMPTS]
    return checkpoint, artifacts, reference


def test_fused_experts_equal_transformers_own_conversion(mixtral):
    checkpoint, artifacts, _ = mixtral
    engine = _engine(artifacts[1, "fp32"])
    ours = dict(engine.model.named_parameters())
    theirs = dict(_hf_model(checkpoint).named_parameters())
    assert sorted(ours) == sorted(theirs)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                 "model.layers.1.mlp.gate.weight"):
        assert torch.equal(ours[name], theirs[name]), name


def test_gate_comes_before_up_in_gate_up_proj(mixtral):
    checkpoint, artifacts, _ = mixtral
    from safetensors.torch import load_file

    hub = load_file(checkpoint / "model.safetensors")
    fused = dict(_engine(artifacts[1, "fp32"]).model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    w1 = hub["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    w3 = hub["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    assert torch.equal(fused[2, : w1.shape[0]], w1)
    assert torch.equal(fused[2, w1.shape[0]:], w3)


def test_tp1_greedy_equals_hf_generate(mixtral):
    _, artifacts, reference = mixtral
    assert _greedy(_engine(artifacts[1, "fp32"])) == reference
    assert len(set(reference[0])) > 5  # a model that says something, not one token over and over


def test_tp1_logits_equal_hf(mixtral):
    checkpoint, artifacts, _ = mixtral
    engine = _engine(artifacts[1, "fp32"])
    ids = engine.tokenizer(PROMPTS[1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours = engine.model(ids).logits
        theirs = _hf_model(checkpoint)(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


def _dequantized_checkpoint(artifact: Path, out: Path) -> Path:
    """The TP=1 int8 shard as a plain fp32 hub checkpoint (W = Q·scale per row): what int8 should compute."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(artifact, out, ignore=shutil.ignore_patterns("shards"))
    shard = load_file(artifact / "shards/tp1/rank0.safetensors")
    plain = {}
    for name, tensor in shard.items():
        if name.endswith("_scale"):
            continue
        scale = shard.get(name + "_scale")
        plain[name] = tensor.float() if scale is None else tensor.float() * scale.float()[:, None]
    save_file(plain, out / "model.safetensors")
    return out


def test_tp1_int8_keeps_experts_int8_and_equals_hf_on_the_dequantized_weights(mixtral, tmp_path):
    _, artifacts, _ = mixtral
    engine = _engine(artifacts[1, "int8"], dtype="int8")
    experts = engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.int8 and experts.down_proj.dtype == torch.int8
    assert tuple(experts.gate_up_scale.shape) == tuple(experts.gate_up_proj.shape[:2])
    dequantized = _dequantized_checkpoint(artifacts[1, "int8"], tmp_path / "dequantized")
    assert _greedy(engine) == [hf_greedy(dequantized, prompt, NEW_TOKENS) for prompt in PROMPTS]


def test_missing_expert_is_a_one_line_artifact_error(mixtral, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, artifacts, _ = mixtral
    artifact = tmp_path / "art"
    shutil.copytree(artifacts[1, "fp32"], artifact)
    shard = artifact / "shards/tp1/rank0.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, shard)
    with pytest.raises(ArtifactError) as info:
        _engine(artifact)
    assert str(info.value) == ("shard has no tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'; "
                               "the artifact does not match its config.json")


def _rank_main(rank: int, opened: list[str], artifacts: dict) -> dict:
    """One TP=2 rank: load each artifact, generate greedily, report tokens, the shard it opened, local experts."""
    out = {}
    for dtype, artifact in artifacts.items():
        engine = create_engine("hf", family="mixtral", task="text-generation", dtype=dtype,
                               tensor_parallel_degree=2, max_sequence_length=128, batch_size=4, device="cpu")
        del opened[:]
        engine.load(artifact, rank, 2)
        experts = engine.model.model.layers[0].mlp.experts
        # numpy: pickled by value, so the arrays outlive this process (torch tensors travel by handle)
        out[dtype] = {"tokens": _greedy(engine), "opened": list(opened),
                      "gate_up": experts.gate_up_proj.numpy().copy(), "down": experts.down_proj.numpy().copy()}
    return out


@pytest.fixture(scope="module")
def tp2_run(mixtral):
    _, artifacts, _ = mixtral
    return run_tp_ranks(_rank_main, {dtype: str(artifacts[2, dtype]) for dtype in ("fp32", "int8")})


def test_tp2_greedy_equals_hf_generate_on_the_whole_checkpoint(mixtral, tp2_run):
    _, _, reference = mixtral
    assert tp2_run[0]["fp32"]["tokens"] == reference
    assert tp2_run[1]["fp32"]["tokens"] == reference


def test_tp2_ranks_hold_their_intermediate_slices_of_every_expert(mixtral, tp2_run):
    checkpoint, _, _ = mixtral
    whole = dict(_hf_model(checkpoint).named_parameters())
    gate_up, down = whole["model.layers.0.mlp.experts.gate_up_proj"], whole["model.layers.0.mlp.experts.down_proj"]
    inter = down.shape[2]
    half = inter // 2
    for rank in range(2):
        rows = slice(rank * half, (rank + 1) * half)
        local = tp2_run[rank]["fp32"]
        expected_gate_up = torch.cat([gate_up[:, :inter][:, rows], gate_up[:, inter:][:, rows]], dim=1)
        assert torch.equal(torch.from_numpy(local["gate_up"]), expected_gate_up)
        assert torch.equal(torch.from_numpy(local["down"]), down[:, :, rows])


def test_tp2_each_rank_opens_only_its_own_shard(mixtral, tp2_run):
    _, artifacts, _ = mixtral
    for rank in range(2):
        assert tp2_run[rank]["fp32"]["opened"] == [os.path.join(str(artifacts[2, "fp32"]),
                                                                 f"shards/tp2/rank{rank}.safetensors")]


def test_tp2_int8_equals_tp1_int8(mixtral, tp2_run):
    _, artifacts, _ = mixtral
    # The partitioner's scales come from whole tensors: every TP degree holds the same quantized model.
    tp1 = _greedy(_engine(artifacts[1, "int8"], dtype="int8"))
    assert tp2_run[0]["int8"]["tokens"] == tp1
    assert tp2_run[1]["int8"]["tokens"] == tp1
    assert str(tp2_run[0]["int8"]["gate_up"].dtype) == "int8"


def test_missing_moe_layer_names_the_layer(tmp_path):
    from lmc.runtime.engines.hf import build_skeleton
    from lmc.runtime.engines.moe import load_moe_blocks
    from lmc.testing.checkpoints import config_for

    model = build_skeleton(config_for("mixtral"), "text-generation", torch.float32)
    state = {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(4, 64)}
    with pytest.raises(ArtifactError) as info:
        load_moe_blocks(model, state, world_size=1)
    assert str(info.value) == ("shard and config.json disagree on the MoE layers "
                               "(first odd one: 'model.layers.1')")
    assert state == {}  # every MoE tensor is taken out of the state, none left for the generic loader
