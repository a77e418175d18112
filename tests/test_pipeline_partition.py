"""partition_pipeline: each stage's files hold only its layers (the first stage the embedding, the last the
final norm and LM head); gathered back, the stages give the checkpoint's tensors exactly."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from lmc.emitters.checkpoint import validate_checkpoint  # noqa: E402
from lmc.emitters.partition import gather_pipeline, partition_pipeline  # noqa: E402
from lmc.errors import CheckpointError  # noqa: E402
from lmc.layouts import stage_layers, stage_shard_path, tensor_stages  # noqa: E402
from lmc.planner.checkpoint_facts import checkpoint_model_facts  # noqa: E402
from lmc.testing import make_checkpoint  # noqa: E402


def test_stage_layers_split_evenly_in_order():
    assert stage_layers(80, 3) == [range(0, 27), range(27, 54), range(54, 80)]
    assert stage_layers(126, 2) == [range(0, 63), range(63, 126)]  # Llama-3.1-405B over two instances
    assert stage_layers(5, 5) == [range(i, i + 1) for i in range(5)]
    with pytest.raises(ValueError, match="cannot be cut into 6 pipeline stages"):
        stage_layers(5, 6)


def test_tensor_stages_place_embedding_norm_and_head():
    assert tensor_stages("model.embed_tokens.weight", 4, 2, tied_head=False) == (0,)
    assert tensor_stages("model.embed_tokens.weight", 4, 2, tied_head=True) == (0, 1)
    assert tensor_stages("model.norm.weight", 4, 2, tied_head=False) == (1,)
    assert tensor_stages("lm_head.weight", 4, 2, tied_head=False) == (1,)
    assert tensor_stages("model.layers.1.mlp.up_proj.weight", 4, 2, tied_head=False) == (0,)
    assert tensor_stages("model.layers.2.input_layernorm.weight", 4, 2, tied_head=False) == (1,)
    with pytest.raises(ValueError, match="layer 4 outside"):
        tensor_stages("model.layers.4.mlp.up_proj.weight", 4, 2, tied_head=False)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    out = {}
    for name, overrides in {"untied": {}, "tied": {"tie_word_embeddings": True}}.items():
        path = make_checkpoint("llama", root / name, num_hidden_layers=5, **overrides)
        facts = checkpoint_model_facts(path, "t/llama")
        original = {}
        info = validate_checkpoint(path, facts)
        for file in info.files:
            original.update(load_file(str(file)))
        out[name] = (info, facts, original)
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_stages_hold_their_layers_and_gather_to_the_checkpoint(llamas, name, tp, tmp_path):
    info, facts, original = llamas[name]
    paths = partition_pipeline(info, family="llama", dtype="fp32", tp=tp, stages=2, layers=5,
                               head_dim=facts.head_dim, kv_heads=facts.kv_heads, out_dir=tmp_path, progress=False)
    assert paths == [[tmp_path / stage_shard_path(2, tp, s, r) for r in range(tp)] for s in range(2)]
    for stage, expected_layers in enumerate([{0, 1, 2}, {3, 4}]):
        with safe_open(str(paths[stage][0]), framework="pt") as handle:
            names = set(handle.keys())
            assert handle.metadata()["lmc.stage"] == str(stage)
        layers = {int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))}
        assert layers == expected_layers
        assert ("model.embed_tokens.weight" in names) == (stage == 0 or name == "tied")
        assert ("model.norm.weight" in names) == (stage == 1)
        assert ("lm_head.weight" in names) == (stage == 1 and name == "untied")
    gathered = gather_pipeline(paths, "llama", facts.head_dim, facts.kv_heads)
    assert gathered.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(gathered[key], tensor), key


def test_other_families_are_refused(tmp_path):
    path = make_checkpoint("gptj", tmp_path / "gptj")
    facts = checkpoint_model_facts(path, "t/gptj")
    with pytest.raises(CheckpointError, match="lmc cuts only the llama family into stages, not gptj"):
        partition_pipeline(validate_checkpoint(path, facts), family="gptj", dtype="fp32", tp=1, stages=2,
                           layers=facts.layers, head_dim=facts.head_dim, kv_heads=facts.kv_heads,
                           out_dir=tmp_path / "out", progress=False)


def _plan(golden: str, **changes):
    import json
    from pathlib import Path

    from lmc.planner.plan import Plan

    plan = Plan.model_validate(json.loads((Path(__file__).parent.parent / "golden" / golden / "plan.json").read_text()))
    deployment = plan.deployment.model_copy(update={"pipeline_parallel_degree": 2, "instances": 2})
    return plan.model_copy(update={"deployment": deployment, **changes})


@pytest.mark.parametrize("golden, changes, message", [
    ("gpt-j-6b-deepspeed-p3-2xlarge", {}, "pipeline parallel degree 2: lmc runs plans across instances on vLLM's "
                                          "multi-node mode or on the hf engine (torch.distributed between the "
                                          "instances), not deepspeed"),
    ("gpt-neox-20b-g5-12xlarge", {"engine": "hf"}, "lmc cuts only the llama family into stages, not gpt_neox"),
])
def test_build_refuses_pipeline_plans_it_cannot_run(golden, changes, message):
    from lmc.emitters.build import check_pipeline_plan
    from lmc.errors import ArtifactError

    with pytest.raises(ArtifactError) as error:
        check_pipeline_plan(_plan(golden, **changes))
    assert message in str(error.value)
    check_pipeline_plan(_plan("tiny-llama-cpu"))  # hf, llama: runs
    check_pipeline_plan(_plan("tiny-llama-cpu", engine="vllm"))  # vLLM's multi-node mode: runs
