"""Neuron AOT compile: the orchestration against a fake transformers_neuronx, and the missing SDK."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

from lmc.emitters import neuron
from lmc.errors import InternalError, LmcError, MissingDependencyError
from lmc.planner.plan import PlanModel

sys.path.insert(0, str(Path(__file__).parent))
from test_render import llama_neuron_plan, make_plan  # noqa: E402


class FakeSDK:
    """A stand-in for the transformers_neuronx module that records every call."""

    def __init__(self, fail: Exception | None = None):
        self.calls: list[tuple] = []
        self.module = types.ModuleType("transformers_neuronx")
        self.module.__version__ = "0.10.0.21"
        for name in set(neuron.SAMPLING_CLASSES.values()):
            setattr(self.module, name, self._model_class(name, fail))
        self.module.NeuronConfig = lambda **kw: ("NeuronConfig", kw)
        self.module.QuantizationConfig = lambda **kw: ("QuantizationConfig", kw)

    def _model_class(self, name, fail):
        sdk = self

        class Model:
            @classmethod
            def from_pretrained(cls, path, **kwargs):
                sdk.calls.append(("from_pretrained", name, path, kwargs))
                return cls()

            def to_neuron(self):
                sdk.calls.append(("to_neuron", os.environ.get("NEURON_CC_FLAGS")))
                if fail is not None:
                    raise fail

            def save(self, directory):
                sdk.calls.append(("save", directory))
                Path(directory, "graph0.neff").write_bytes(b"NEFF0")
                Path(directory, "graph1.neff").write_bytes(b"NEFF1")

        Model.__name__ = name
        return Model


@pytest.fixture
def fake_sdk(monkeypatch):
    sdk = FakeSDK()
    monkeypatch.setitem(sys.modules, "transformers_neuronx", sdk.module)
    return sdk


def test_compile_plan_spells_out_the_call(tmp_path):
    spec = neuron.neuron_compile_plan(llama_neuron_plan(), tmp_path)
    assert spec.class_name == "LlamaForSampling"
    assert spec.from_pretrained == {"batch_size": 4, "tp_degree": 8, "n_positions": 2048, "amp": "bf16",
                                    "context_length_estimate": [128, 256, 512, 1024, 2048]}
    assert spec.neuron_cc_flags == "--model-type=transformer -O2"
    assert spec.compiled_dir == tmp_path / "neuron" / "compiled"
    assert spec.serializable and not spec.quantize_int8


def test_compile_runs_from_pretrained_to_neuron_save(tmp_path, fake_sdk, monkeypatch):
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    sdk = neuron.load_neuron_sdk()
    assert sdk is fake_sdk.module
    spec = neuron.neuron_compile_plan(llama_neuron_plan(), tmp_path)
    written = neuron.run_neuron_compile(spec, sdk)

    assert fake_sdk.calls == [
        ("from_pretrained", "LlamaForSampling", str(tmp_path), {"batch_size": 4, "tp_degree": 8, "n_positions": 2048, "amp": "bf16",
                                                              "context_length_estimate": [128, 256, 512, 1024, 2048]}),
        ("to_neuron", "--model-type=transformer -O2"),
        ("save", str(tmp_path / "neuron" / "compiled")),
    ]
    assert "NEURON_CC_FLAGS" not in os.environ  # restored after the compile
    rel = sorted(p.relative_to(tmp_path).as_posix() for p in written)
    assert rel == ["neuron/compile.json", "neuron/compiled/graph0.neff", "neuron/compiled/graph1.neff"]
    record = json.loads((tmp_path / "neuron" / "compile.json").read_text())
    assert record["compiled"] is True
    assert record["class"] == "transformers_neuronx.LlamaForSampling"
    assert record["from_pretrained"]["tp_degree"] == 8
    assert record["graphs"] == "neuron/compiled"
    assert record["sdk_versions"]["transformers-neuronx"] == "0.10.0.21"


@pytest.mark.parametrize(("family", "cls"), [("mistral", "MistralForSampling"), ("opt", "OPTForSampling"),
                                             ("bloom", "BloomForSampling")])
def test_class_follows_the_family(tmp_path, fake_sdk, family, cls):
    plan = llama_neuron_plan(model=PlanModel(id="x", family=family, parameters=1, layers=1, hidden_size=8,
                                             attention_heads=8, kv_heads=8, vocab_size=8))
    neuron.run_neuron_compile(neuron.neuron_compile_plan(plan, tmp_path), fake_sdk.module)
    assert fake_sdk.calls[0][1] == cls


def test_int8_passes_a_quantization_config(tmp_path, fake_sdk):
    spec = neuron.neuron_compile_plan(llama_neuron_plan(dtype="int8"), tmp_path)
    neuron.run_neuron_compile(spec, fake_sdk.module)
    kwargs = fake_sdk.calls[0][3]
    assert kwargs["amp"] == "f16"
    assert kwargs["neuron_config"] == ("NeuronConfig", {"quant": ("QuantizationConfig", {"quant_dtype": "s8", "dequant_dtype": "f16"})})


def test_gptj_is_never_compiled(tmp_path, fake_sdk):
    plan = make_plan(engine="neuronx")  # gptj
    assert not neuron.graphs_precompiled(plan, weights_remote=False)
    with pytest.raises(InternalError, match="GPTJForSampling, whose graphs cannot be saved"):
        neuron.run_neuron_compile(neuron.neuron_compile_plan(plan, tmp_path), fake_sdk.module)
    assert fake_sdk.calls == []
    record = neuron.deferred_compile_record(plan, weights_remote=False)
    assert record["compiled"] is False
    assert "cannot serialize compiled GPTJForSampling graphs" in record["reason"]
    assert record["predicted_load_seconds_including_compile"] == 30.0


def test_compiler_failure_is_one_line(tmp_path, monkeypatch):
    sdk = FakeSDK(fail=RuntimeError("neuronx-cc exited 70\nsee log"))
    spec = neuron.neuron_compile_plan(llama_neuron_plan(), tmp_path)
    with pytest.raises(LmcError) as info:
        neuron.run_neuron_compile(spec, sdk.module)
    assert str(info.value) == ("Neuron compile of meta-llama/Llama-2-7b-hf (LlamaForSampling) failed: "
                               "RuntimeError: neuronx-cc exited 70 see log")


def test_missing_sdk_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)  # import raises ImportError
    with pytest.raises(MissingDependencyError) as info:
        neuron.load_neuron_sdk()
    message = str(info.value)
    assert "\n" not in message
    assert "pip install transformers-neuronx torch-neuronx neuronx-cc" in message
    assert "https://pip.repos.neuron.amazonaws.com" in message
    assert "inf2/trn1" in message and "Neuron deep learning container" in message


def test_non_neuron_plan_is_an_internal_error(tmp_path):
    with pytest.raises(InternalError, match="neuron_compile_plan called for a deepspeed plan"):
        neuron.neuron_compile_plan(make_plan(), tmp_path)


def test_agrees_with_the_planner_on_what_can_be_precompiled():
    from lmc.planner.engines import engine_facts

    facts = engine_facts()["neuronx"]
    assert set(facts.families) <= set(neuron.SAMPLING_CLASSES)
    assert set(facts.aot_compile_families) == set(facts.families) - neuron.NOT_SERIALIZABLE


def test_the_neuron_image_serves_with_the_sdk_the_build_compiles_with():
    """NEFFs load only under the compiler that made them: the Dockerfile's DLC tag and its
    transformers-neuronx pin must be the release whose packages the build pins."""
    import re
    from pathlib import Path

    from lmc.neuron_sdk import NEURON_SDK_PINS, NEURON_SDK_RELEASE

    dockerfile = (Path(__file__).resolve().parent.parent / "docker/Dockerfile.neuron").read_text()
    tag = re.search(r"^ARG NEURON_DLC=\S+:(\S+)$", dockerfile, re.M).group(1)
    assert f"-sdk{NEURON_SDK_RELEASE}." in tag
    assert tag.startswith(NEURON_SDK_PINS["torch-neuronx"].rsplit(".", 3)[0] + "-")  # torch 2.1.2 in the DLC
    assert f"transformers-neuronx=={NEURON_SDK_PINS['transformers-neuronx']}" in dockerfile
