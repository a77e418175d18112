"""partition_checkpoint: at TP 4 the ranks rebuild the model transformers builds from the whole checkpoint (its
logits); gathering the rank files gives the checkpoint back."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from lmc.emitters.checkpoint import validate_checkpoint  # noqa: E402
from lmc.emitters.partition import SCALE_SUFFIX, gather_shards, partition_checkpoint  # noqa: E402
from lmc.emitters.safetensors_stream import StreamingWriter, read_header, read_tensor  # noqa: E402
from lmc.errors import CheckpointError  # noqa: E402
from lmc.layouts import shard_path  # noqa: E402
from lmc.planner.checkpoint_facts import checkpoint_model_facts  # noqa: E402
from lmc.testing import FAMILIES, make_checkpoint  # noqa: E402

try:
    from _engine_helpers import build_artifact, hf_logits, logits_at_every_position, run_tp_ranks  # noqa: E402
    from _engine_helpers import make_checkpoint as make_wide_checkpoint  # noqa: E402
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import build_artifact, hf_logits, logits_at_every_position, run_tp_ranks  # noqa: E402
    from tests._engine_helpers import make_checkpoint as make_wide_checkpoint  # noqa: E402

PROMPT = "héllo wörld, large models are served"

_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (info, facts, original tensors); llama is sharded to cover multi-file checkpoints."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for family in FAMILIES:
        path = make_checkpoint(family, root / family, shards=2 if family == "llama" else 1)
        facts = checkpoint_model_facts(path, family)
        info = validate_checkpoint(path, facts)
        original = {}
        for file in info.files:
            original.update(load_file(str(file)))
        out[family] = (info, facts, original)
    return out


def _partition(checkpoints, family, tp, dtype, out_dir):
    info, facts, _ = checkpoints[family]
    return partition_checkpoint(info, family=family, dtype=dtype, tp=tp, head_dim=facts.head_dim,
                                kv_heads=facts.kv_heads, out_dir=out_dir, progress=False)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_gather_reproduces_checkpoint(checkpoints, family, tp, tmp_path):
    _, facts, original = checkpoints[family]
    paths = _partition(checkpoints, family, tp, "fp16", tmp_path)
    assert paths == [tmp_path / shard_path(tp, rank) for rank in range(tp)]
    gathered = gather_shards(paths, family, facts.head_dim, facts.kv_heads)
    assert gathered.keys() == original.keys()
    for name, tensor in original.items():
        assert gathered[name].dtype == torch.float16, name
        assert torch.equal(gathered[name], tensor.half()), name


def _tp4_rank(rank: int, opened: list[str], artifacts: dict[str, str]) -> dict:
    """One of 4 TP ranks: each family's artifact loaded by the hf engine from this rank's file alone, and
    its logits at every position of PROMPT."""
    from lmc.runtime.engines import create_engine

    out = {}
    for family, artifact in artifacts.items():
        task = "text2text-generation" if family == "t5" else "text-generation"
        engine = create_engine("hf", family=family, task=task, dtype="fp32", tensor_parallel_degree=4,
                               max_sequence_length=128, batch_size=1, device="cpu")
        del opened[:]
        engine.load(artifact, rank, 4)
        out[family] = {"opened": list(opened),
                       "logits": logits_at_every_position(engine.model, engine.tokenizer, family, PROMPT).tolist()}
    return out


@pytest.fixture(scope="module")
def tp4_run(tmp_path_factory):
    """Every family partitioned at TP 4 by the build's partitioner and served by 4 ranks over gloo."""
    root = tmp_path_factory.mktemp("tp4")
    checkpoints = {family: make_wide_checkpoint(family, root / family / "ckpt") for family in FAMILIES}
    artifacts = {family: str(build_artifact(checkpoint, root / family / "art", 4))
                 for family, checkpoint in checkpoints.items()}
    return checkpoints, artifacts, run_tp_ranks(_tp4_rank, artifacts, world_size=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp4_shards_give_the_hf_models_logits(tp4_run, family):
    """The independent reference for the partitioner's slices: transformers' own model on the whole
    checkpoint. A weight cut along the wrong dimension, or the right part given to the wrong rank, changes
    the logits of the model the 4 ranks rebuild from their files (each opens only its own)."""
    checkpoints, artifacts, results = tp4_run
    reference = hf_logits(checkpoints[family], family, PROMPT)
    for rank in range(4):
        assert results[rank][family]["opened"] == [f"{artifacts[family]}/{shard_path(4, rank)}"]
        logits = torch.tensor(results[rank][family]["logits"])
        assert logits.shape == reference.shape
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))


@pytest.mark.parametrize("family", FAMILIES)
def test_rank_files_hold_every_tensor_and_cut_some(checkpoints, family, tmp_path):
    """At TP 4 each rank's file holds every tensor of the checkpoint (its own slice or the whole), some cut."""
    _, facts, original = checkpoints[family]
    paths = _partition(checkpoints, family, 4, "fp32", tmp_path)
    smaller = set()
    for path in paths:
        tensors = load_file(str(path))
        assert tensors.keys() == original.keys()
        smaller |= {name for name, full in original.items() if tensors[name].numel() < full.numel()}
    assert smaller


def test_gqa_kv_heads_replicated_beyond_kv_count(checkpoints, tmp_path):
    # llama has 2 kv heads: at TP 4 ranks 0,1 hold head 0 and ranks 2,3 hold head 1.
    _, facts, original = checkpoints["llama"]
    paths = _partition(checkpoints, "llama", 4, "fp32", tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    parts = [load_file(str(p))[name] for p in paths]
    head = facts.head_dim
    assert torch.equal(parts[0], parts[1]) and torch.equal(parts[2], parts[3])
    assert torch.equal(parts[2], original[name][head:2 * head])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_float_dtypes_are_exact_casts(checkpoints, dtype, tmp_path):
    _, facts, original = checkpoints["qwen2"]
    paths = _partition(checkpoints, "qwen2", 2, dtype, tmp_path)
    gathered = gather_shards(paths, "qwen2", facts.head_dim, facts.kv_heads)
    assert all(torch.equal(gathered[n], t.to(_TORCH[dtype])) for n, t in original.items())


@pytest.mark.parametrize("dtype,qmax,tolerance", [("int8", 127.0, 0.5 + 1e-3), ("fp8", 448.0, 0.07 * 448)])
def test_weight_only_quantization(checkpoints, dtype, qmax, tolerance, tmp_path):
    _, facts, original = checkpoints["llama"]
    paths = _partition(checkpoints, "llama", 2, dtype, tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"  # row-split: scales are whole on every rank
    with safe_open(str(paths[1]), "pt") as handle:
        meta = handle.metadata()
        assert handle.get_slice(name).get_dtype() == ("I8" if dtype == "int8" else "F8_E4M3")
        assert handle.get_slice(name + SCALE_SUFFIX).get_shape() == [64]
        assert handle.get_slice("model.embed_tokens.weight").get_dtype() == "F16"
    assert meta["lmc.quantization"] == "per-row-symmetric" and meta["lmc.scale_suffix"] == SCALE_SUFFIX
    gathered = gather_shards(paths, "llama", facts.head_dim, facts.kv_heads)
    assert not any(n.endswith(SCALE_SUFFIX) for n in gathered)
    for n, t in original.items():
        if n.endswith("proj.weight"):
            scale = t.abs().amax(dim=1, keepdim=True) / qmax
            assert ((gathered[n] - t).abs() <= tolerance * scale).all(), n
        else:
            assert torch.equal(gathered[n], t.half()), n


def test_int8_is_same_model_at_every_tp(checkpoints, tmp_path):
    _, facts, _ = checkpoints["llama"]
    one = gather_shards(_partition(checkpoints, "llama", 1, "int8", tmp_path / "1"), "llama", facts.head_dim, facts.kv_heads)
    four = gather_shards(_partition(checkpoints, "llama", 4, "int8", tmp_path / "4"), "llama", facts.head_dim, facts.kv_heads)
    assert all(torch.equal(one[n], four[n]) for n in one)


def test_metadata_and_deterministic_bytes(checkpoints, tmp_path):
    first = _partition(checkpoints, "bloom", 2, "fp16", tmp_path / "a")
    second = _partition(checkpoints, "bloom", 2, "fp16", tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    header = read_header(first[1])
    assert header.metadata == {"format": "pt", "lmc.family": "bloom", "lmc.tp": "2", "lmc.rank": "1", "lmc.dtype": "fp16"}
    assert list(header.tensors) == sorted(header.tensors)
    assert header.data_start % 8 == 0


def test_untp_friendly_checkpoint_is_refused(tmp_path):
    path = make_checkpoint("llama", tmp_path / "odd", tp_friendly=False)
    facts = checkpoint_model_facts(path, "odd")
    info = validate_checkpoint(path, facts)
    with pytest.raises(CheckpointError) as error:
        partition_checkpoint(info, family="llama", dtype="fp16", tp=2, head_dim=facts.head_dim, kv_heads=facts.kv_heads,
                             out_dir=tmp_path / "out", progress=False)
    assert "cannot be split for tensor parallel degree 2" in str(error.value)
    assert str(path / "model.safetensors") in str(error.value)
    assert not list((tmp_path / "out").rglob("*.safetensors"))  # nothing half-written left behind


def test_streaming_writer_output_loads_with_safetensors(tmp_path):
    tensors = {"b.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "a.bias": torch.ones(3, dtype=torch.float16),
               "c.q": torch.tensor([[1, -2]], dtype=torch.int8), "d.bf": torch.full((5,), 0.5, dtype=torch.bfloat16)}
    entries = [(n, {"torch.float32": "F32", "torch.float16": "F16", "torch.int8": "I8", "torch.bfloat16": "BF16"}[str(t.dtype)],
                tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "s.safetensors"
    with StreamingWriter(path, entries, {"format": "pt", "lmc.rank": "0"}) as writer:
        for name in ["c.q", "a.bias", "d.bf", "b.weight"]:  # any order
            writer.write(name, tensors[name])
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], t) for n, t in tensors.items())
    header = read_header(path)
    assert header.data_start % 8 == 0
    assert torch.equal(read_tensor(path, header.tensors["b.weight"], dim=1, start=1, stop=3), tensors["b.weight"][:, 1:3])
    assert torch.equal(read_tensor(path, header.tensors["b.weight"], dim=0, start=2, stop=3), tensors["b.weight"][2:3])


def test_streaming_writer_removes_file_when_a_tensor_is_missing(tmp_path):
    path = tmp_path / "s.safetensors"
    with pytest.raises(RuntimeError):
        with StreamingWriter(path, [("a", "F32", (2,))]) as writer:
            raise RuntimeError("boom")
    assert not path.exists()
    writer = StreamingWriter(path, [("a", "F32", (2,)), ("b", "F32", (1,))])
    writer.write("a", torch.zeros(2))
    with pytest.raises(Exception, match="1 declared tensors never written"):
        writer.close()


def test_progress_bar_when_asked(checkpoints, tmp_path, capsys):
    _partition(checkpoints, "opt", 1, "fp16", tmp_path / "quiet")
    assert "partitioning" not in capsys.readouterr().err
    info, facts, _ = checkpoints["opt"]
    partition_checkpoint(info, family="opt", dtype="fp16", tp=1, head_dim=facts.head_dim, kv_heads=facts.kv_heads,
                         out_dir=tmp_path / "loud", progress=True)
    assert "partitioning" in capsys.readouterr().err


def test_a_cast_that_overflows_float16_is_refused_not_written_as_inf(tmp_path):
    from safetensors.torch import save_file

    path = make_checkpoint("llama", tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"][3] = 1e5  # fine in fp32 and bf16, beyond fp16's 65504
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    info = validate_checkpoint(path, checkpoint_model_facts(path, "x"))
    with pytest.raises(CheckpointError) as excinfo:
        partition_checkpoint(info, family="llama", dtype="fp16", tp=1, head_dim=16, kv_heads=2, out_dir=tmp_path / "out")
    assert "tensor 'model.norm.weight' has values beyond float16's range (|x| > 65504)" in str(excinfo.value)
    partition_checkpoint(info, family="llama", dtype="bf16", tp=1, head_dim=16, kv_heads=2, out_dir=tmp_path / "bf16")


def test_quantization_scales_never_underflow_to_nan():
    from lmc.emitters.partition import _quantize, _row_scales

    rows = torch.tensor([[1e-43, 0.0, -5e-44], [0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    for dtype, qmax in (("fp8", 448.0), ("int8", 127.0)):
        scale = _row_scales(rows, qmax)
        assert bool((scale > 0).all())
        assert bool(torch.isfinite(_quantize(rows, scale, dtype).float()).all())
