"""The neuronx engine's orchestration against a fake transformers_neuronx (the SDK is not installable here)."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

try:
    from _engine_helpers import make_checkpoint
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import make_checkpoint

from lmc.errors import InternalError, MissingDependencyError
from lmc.runtime.engines import create_engine
from lmc.runtime.engines.base import GenerationParams, GenerationRequest
from lmc.testing.checkpoints import EOS_ID


class _FakeSampling:
    calls: list = []

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        cls.calls.append(("from_pretrained", path, kwargs))
        return cls()

    def load(self, path):
        self.calls.append(("load", path))

    def to_neuron(self):
        self.calls.append(("to_neuron",))

    def sample(self, input_ids, sequence_length, **kwargs):
        self.calls.append(("sample", tuple(input_ids.shape), sequence_length, kwargs))
        new = torch.tensor([[65, 66, 67, EOS_ID, 68]] * input_ids.shape[0])[:, :sequence_length - input_ids.shape[1]]
        return torch.cat([input_ids, new], dim=1)


@pytest.fixture
def fake_sdk(monkeypatch):
    sdk = types.ModuleType("transformers_neuronx")
    classes = {}
    for name in ("LlamaForSampling", "GPTJForSampling", "GPTNeoXForSampling", "OPTForSampling"):
        classes[name] = type(name, (_FakeSampling,), {"calls": []})
        setattr(sdk, name, classes[name])
    sdk.NeuronConfig = lambda **kw: ("NeuronConfig", kw)
    sdk.QuantizationConfig = lambda **kw: ("QuantizationConfig", kw)
    monkeypatch.setitem(sys.modules, "transformers_neuronx", sdk)
    return classes


def _engine(family="llama", dtype="fp16", tp=2, batch=4):
    return create_engine("neuronx", family=family, task="text-generation", dtype=dtype, tensor_parallel_degree=tp,
                         max_sequence_length=64, batch_size=batch, device="neuron")


def test_precompiled_graphs_load_before_to_neuron(fake_sdk, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    model_dir = make_checkpoint("llama", tmp_path / "art")
    (model_dir / "neuron/compiled").mkdir(parents=True)
    (model_dir / "neuron/compiled/graph.neff").write_bytes(b"neff")
    engine = _engine()
    engine.load(model_dir, 0, 1)
    calls = fake_sdk["LlamaForSampling"].calls
    assert calls[0] == ("from_pretrained", str(model_dir),
                        {"batch_size": 4, "tp_degree": 2, "n_positions": 64, "amp": "f16"})
    assert calls[1:] == [("load", str(model_dir / "neuron/compiled")), ("to_neuron",)]


def test_without_graphs_it_compiles_at_start(fake_sdk, tmp_path):
    model_dir = make_checkpoint("gptj", tmp_path / "art")
    _engine("gptj", dtype="int8").load(model_dir, 0, 1)
    calls = fake_sdk["GPTJForSampling"].calls
    assert [c[0] for c in calls] == ["from_pretrained", "to_neuron"]
    assert calls[0][2]["neuron_config"] == ("NeuronConfig", {"quant": ("QuantizationConfig",
                                                                       {"quant_dtype": "s8", "dequant_dtype": "f16"})})


def test_generate_groups_by_parameters_pads_to_the_compiled_batch_and_cuts_at_eos(fake_sdk, tmp_path):
    model_dir = make_checkpoint("llama", tmp_path / "art")
    engine = _engine()
    engine.load(model_dir, 0, 1)
    pieces = []
    results = engine.generate([GenerationRequest("a", "the quick", GenerationParams(max_new_tokens=5)),
                               GenerationRequest("b", "héllo", GenerationParams(max_new_tokens=2, do_sample=True,
                                                                               top_k=5, seed=3))],
                              on_token=lambda rid, piece: pieces.append((rid, piece)))
    samples = [c for c in fake_sdk["LlamaForSampling"].calls if c[0] == "sample"]
    assert len(samples) == 2 and all(c[1][0] == 4 for c in samples)  # two groups, each padded to batch 4
    assert samples[0][3] == {"top_k": 1}  # greedy
    assert samples[1][3] == {"top_k": 5, "top_p": 1.0, "temperature": 1.0}
    assert results[0].token_ids == [65, 66, 67] and results[0].finish_reason == "eos"  # EOS_ID ends it
    assert results[1].token_ids == [65, 66] and results[1].finish_reason == "length"
    assert dict(pieces) == {"a": results[0].text, "b": results[1].text}


def test_missing_sdk_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)
    with pytest.raises(MissingDependencyError) as excinfo:
        _engine().load(tmp_path, 0, 1)
    message = str(excinfo.value)
    assert "pip install transformers-neuronx torch-neuronx neuronx-cc --extra-index-url" in message
    assert "Neuron host (inf2/trn1)" in message and "\n" not in message


def test_a_multi_process_group_is_refused(fake_sdk, tmp_path):
    with pytest.raises(InternalError) as excinfo:
        _engine().load(tmp_path, 1, 2)
    assert "a neuronx worker group is one process" in str(excinfo.value)
