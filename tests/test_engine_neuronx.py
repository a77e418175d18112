"""The neuronx engine's orchestration against a fake transformers_neuronx (the SDK is not installable here)."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

try:
    from _engine_helpers import hf_greedy, make_checkpoint
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import hf_greedy, make_checkpoint

from lmc.errors import InternalError, MissingDependencyError
from lmc.runtime.engines import create_engine
from lmc.runtime.engines.base import GenerationParams, GenerationRequest
from lmc.testing.checkpoints import EOS_ID


class _FakeSampling:
    """A transformers-neuronx `*ForSampling` class as lmc uses it: from_pretrained / load / to_neuron,
    then `model(input_ids, cache_ids, start_ids)` -> next-token logits [batch, vocab]. The forward
    keeps the SDK's contract and refuses what the compiled graphs would not take: a batch other than
    the compiled one, a decode step that is not the next position, a position past n_positions.
    Logits come from the real tiny HF model run over every position so far, rows masked before their
    start_ids, with the cache positions as position ids (as the SDK does with left padding)."""

    calls: list = []
    honours_start_ids = True  # the real GPTJForSampling does not (its mask comes from cache positions)

    def __init__(self, path, batch_size, n_positions):
        import transformers

        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.batch_size, self.n_positions = batch_size, n_positions
        self.tokens = None

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        cls.calls.append(("from_pretrained", path, kwargs))
        return cls(path, kwargs["batch_size"], kwargs["n_positions"])

    def load(self, path):
        self.calls.append(("load", path))

    def to_neuron(self):
        self.calls.append(("to_neuron",))

    def sample(self, *args, **kwargs):
        raise AssertionError("lmc runs its own decode loop over forward; sample() must not be called")

    def __call__(self, input_ids, cache_ids, start_ids):
        if input_ids.shape[0] != self.batch_size:
            raise ValueError(f"Model not compiled for batch_size : {input_ids.shape[0]}")
        assert start_ids.dtype == torch.int32 and start_ids.shape == (self.batch_size,)
        if cache_ids is None:  # context encoding: positions 0..width-1
            self.calls.append(("prefill", tuple(input_ids.shape), start_ids.tolist()))
            self.tokens, self.start_ids = input_ids.clone(), start_ids.clone()
        else:  # one token per row at position cache_ids[0]
            assert input_ids.shape == (self.batch_size, 1) and cache_ids.dtype == torch.int32
            position = int(cache_ids[0])
            assert position == self.tokens.shape[1], "decode steps must feed the next position"
            assert torch.equal(start_ids, self.start_ids)
            self.tokens = torch.cat([self.tokens, input_ids], dim=1)
        if self.tokens.shape[1] > self.n_positions:
            raise RuntimeError(f"position {self.tokens.shape[1] - 1} is past n_positions {self.n_positions}")
        width = self.tokens.shape[1]
        if hasattr(self, "num_processed_tokens"):
            if cache_ids is None:
                self.calls.append(("processed_at_prefill", int(self.num_processed_tokens)))
            self.num_processed_tokens += input_ids.shape[1]
        starts = self.start_ids if self.honours_start_ids else torch.zeros_like(self.start_ids)
        mask = (torch.arange(width)[None, :] >= starts[:, None]).long()
        positions = torch.arange(width)[None, :].expand(self.batch_size, width)
        with torch.no_grad():
            return self.hf(input_ids=self.tokens, attention_mask=mask, position_ids=positions).logits[:, -1, :]


class _ScriptedSampling(_FakeSampling):
    """Same contract; the logits favour a fixed token sequence (step by step), EOS included."""

    SCRIPT = [65, 66, 67, EOS_ID, 68]

    def __call__(self, input_ids, cache_ids, start_ids):
        step = 0 if cache_ids is None else int(cache_ids[0]) - self.width + 1
        if cache_ids is None:
            self.width = input_ids.shape[1]
        logits = torch.zeros(self.batch_size, self.vocab)
        logits[:, self.SCRIPT[min(step, len(self.SCRIPT) - 1)]] = 10.0
        return logits

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        import json

        cls.calls.append(("from_pretrained", path, kwargs))
        model = cls.__new__(cls)
        model.batch_size = kwargs["batch_size"]
        model.vocab = json.loads((__import__("pathlib").Path(path) / "config.json").read_text())["vocab_size"]
        return model


@pytest.fixture
def fake_sdk(monkeypatch):
    sdk = types.ModuleType("transformers_neuronx")
    classes = {}
    for name in ("LlamaForSampling", "GPTJForSampling", "GPTNeoXForSampling", "OPTForSampling"):
        classes[name] = type(name, (_FakeSampling,), {"calls": [], "honours_start_ids": name != "GPTJForSampling"})
        setattr(sdk, name, classes[name])
    sdk.NeuronConfig = lambda **kw: ("NeuronConfig", kw)
    sdk.QuantizationConfig = lambda **kw: ("QuantizationConfig", kw)
    monkeypatch.setitem(sys.modules, "transformers_neuronx", sdk)
    return classes


def _engine(family="llama", dtype="fp16", tp=2, batch=4, positions=64):
    return create_engine("neuronx", family=family, task="text-generation", dtype=dtype, tensor_parallel_degree=tp,
                         max_sequence_length=positions, batch_size=batch, device="neuron")


def test_precompiled_graphs_load_before_to_neuron(fake_sdk, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    model_dir = make_checkpoint("llama", tmp_path / "art")
    (model_dir / "neuron/compiled").mkdir(parents=True)
    (model_dir / "neuron/compiled/graph.neff").write_bytes(b"neff")
    engine = _engine()
    engine.load(model_dir, 0, 1)
    calls = fake_sdk["LlamaForSampling"].calls
    assert calls[0] == ("from_pretrained", str(model_dir),
                        {"batch_size": 4, "tp_degree": 2, "n_positions": 64, "amp": "f16",
                         "context_length_estimate": [64]})
    assert calls[1:] == [("load", str(model_dir / "neuron/compiled")), ("to_neuron",)]


def test_without_graphs_it_compiles_at_start(fake_sdk, tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("NEURON_CC_FLAGS", "placeholder")
    monkeypatch.delenv("NEURON_CC_FLAGS")
    model_dir = make_checkpoint("gptj", tmp_path / "art")
    _engine("gptj", dtype="fp16").load(model_dir, 0, 1)
    assert os.environ["NEURON_CC_FLAGS"] == "--model-type=transformer -O2"  # as a build-time compile
    calls = fake_sdk["GPTJForSampling"].calls
    assert [c[0] for c in calls] == ["from_pretrained", "to_neuron"]
    # GPT-J's class takes no context_length_estimate and no quantization config (the planner keeps
    # int8 away from it): plain arguments only.
    assert calls[0][2] == {"batch_size": 4, "tp_degree": 2, "n_positions": 64, "amp": "f16"}


def test_int8_weights_are_stored_s8_and_dequantized_to_fp16(fake_sdk, tmp_path):
    model_dir = make_checkpoint("llama", tmp_path / "art")
    _engine("llama", dtype="int8").load(model_dir, 0, 1)
    kwargs = fake_sdk["LlamaForSampling"].calls[0][2]
    assert kwargs["neuron_config"] == ("NeuronConfig", {"quant": ("QuantizationConfig",
                                                                  {"quant_dtype": "s8", "dequant_dtype": "f16"})})


def test_context_buckets_reach_n_positions():
    from lmc.neuron_sdk import context_buckets

    assert context_buckets(1280) == [128, 256, 512, 1024, 1280]
    assert context_buckets(2048) == [128, 256, 512, 1024, 2048]
    assert context_buckets(64) == [64]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_greedy_over_the_sdk_forward_equals_hf_generate_in_a_mixed_length_batch(fake_sdk, tmp_path, family):
    """Left padding with start_ids, filler rows up to the compiled batch, one position per step:
    each request decodes to HF generate's tokens on its own, and streams them piece by piece. Rows that
    finish first stay in the batch (the graphs are compiled for batch 4: the fake refuses any other)."""
    model_dir = make_checkpoint(family, tmp_path / "art")
    engine = _engine(family, batch=4)
    engine.load(model_dir, 0, 1)
    prompts = {"a": "the quick brown fox jumps over", "b": "hello", "c": "a b c"}
    new_tokens = {"a": 6, "b": 2, "c": 4}
    pieces: dict[str, list[str]] = {}
    requests = [GenerationRequest(rid, prompt, GenerationParams(max_new_tokens=new_tokens[rid]))
                for rid, prompt in prompts.items()]
    results = engine.generate(requests, on_token=lambda rid, piece: pieces.setdefault(rid, []).append(piece.text))
    for request, result in zip(requests, results):
        assert result.token_ids == hf_greedy(model_dir, request.prompt, new_tokens[request.id]), request.id
        assert "".join(pieces[request.id]) == result.text
    assert all(len(pieces[rid]) > 1 for rid in prompts)  # streamed as it decodes, not once at the end
    cls = next(c for c in fake_sdk.values() if any(call[0] == "prefill" for call in c.calls))
    prefills = [c for c in cls.calls if c[0] == "prefill"]
    widths = {rid: engine.count_tokens(p) for rid, p in prompts.items()}
    width = max(widths.values())
    assert prefills == [("prefill", (4, width), [width - widths["a"], width - widths["b"], width - widths["c"],
                                                 width - widths["a"]])]


def test_sampling_knobs_work_on_families_whose_sdk_sample_lacks_them(fake_sdk, tmp_path):
    """GPT-J's sample() takes top_k only: lmc's loop applies temperature/top_p/seed itself, per request,
    with greedy and sampled requests in one batch (one prefill)."""
    model_dir = make_checkpoint("gptj", tmp_path / "art")
    engine = _engine("gptj", batch=2)
    engine.load(model_dir, 0, 1)
    sampled = GenerationParams(max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.9, top_k=0, seed=11)
    batch = [GenerationRequest("g", "the quick", GenerationParams(max_new_tokens=8)),
             GenerationRequest("s", "the quick", sampled)]
    first = engine.generate(batch)
    again = engine.generate(batch)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]  # the seed makes sampling repeatable
    assert first[0].token_ids == hf_greedy(model_dir, "the quick", 8)
    other_seed = engine.generate([GenerationRequest("s2", "the quick", GenerationParams(
        max_new_tokens=8, do_sample=True, temperature=5.0, top_k=0, seed=12))])[0]
    assert other_seed.token_ids != first[0].token_ids  # a hot temperature leaves the greedy path
    assert sum(c[0] == "prefill" for c in fake_sdk["GPTJForSampling"].calls) == 3  # one per generate call


def test_a_batch_is_split_to_fit_the_compiled_positions(fake_sdk, tmp_path):
    """Left padding puts every row at the widest prompt's position: a long prompt and a long answer
    cannot share a run when together they pass n_positions (the fake refuses such a step)."""
    model_dir = make_checkpoint("llama", tmp_path / "art")
    engine = _engine(batch=4, positions=40)
    engine.load(model_dir, 0, 1)
    words = ["fox"]
    while engine.count_tokens(" ".join(words + ["fox"])) <= 40 - 4:
        words.append("fox")
    long_prompt = " ".join(words)
    assert 30 <= engine.count_tokens(long_prompt) <= 40 - 4  # fits with its 4 new tokens, not with 30
    requests = [GenerationRequest("long", long_prompt, GenerationParams(max_new_tokens=4)),
                GenerationRequest("short", "hello", GenerationParams(max_new_tokens=30))]
    results = engine.generate(requests)
    assert [r.generated_tokens for r in results] == [len(r.token_ids) for r in results]
    assert results[0].token_ids == hf_greedy(model_dir, long_prompt, 4)
    assert results[1].token_ids == hf_greedy(model_dir, "hello", 30)
    assert sum(c[0] == "prefill" for c in fake_sdk["LlamaForSampling"].calls) == 2


def test_pack_batches_keeps_order_batch_size_and_positions():
    from lmc.runtime.engines.generate import pack_batches

    items, lengths, new = ["a", "b", "c", "d", "e"], [10, 12, 8, 5, 40], [4, 4, 4, 50, 4]
    # a+b (batch full); c+d: width 8, longest 50 -> 58 fits; e: 40 + 4 fits alone
    assert pack_batches(items, lengths, new, 2, 64) == [["a", "b"], ["c", "d"], ["e"]]
    # a,b,c fit (12 + 4); d: 12 + 50 = 62 fits; e: width 40 + longest 50 = 90 does not: a new run
    assert pack_batches(items, lengths, new, 8, 64) == [["a", "b", "c", "d"], ["e"]]
    # same_length: a new run wherever the prompt length changes (the loop sorts by length first)
    assert pack_batches(["p", "q", "r", "s"], [3, 3, 5, 5], [4] * 4, 8, 64, same_length=True) == [["p", "q"], ["r", "s"]]


def test_eos_and_stop_sequences_end_rows_and_filler_rows_are_dropped(monkeypatch, tmp_path):
    sdk = types.ModuleType("transformers_neuronx")
    sdk.LlamaForSampling = type("LlamaForSampling", (_ScriptedSampling,), {"calls": []})
    monkeypatch.setitem(sys.modules, "transformers_neuronx", sdk)
    model_dir = make_checkpoint("llama", tmp_path / "art")
    engine = _engine(batch=4)
    engine.load(model_dir, 0, 1)
    results = engine.generate([GenerationRequest("a", "the quick", GenerationParams(max_new_tokens=5)),
                               GenerationRequest("b", "héllo", GenerationParams(max_new_tokens=2))])
    assert len(results) == 2
    assert results[0].token_ids == [65, 66, 67] and results[0].finish_reason == "eos"  # EOS_ID ends it
    assert results[1].token_ids == [65, 66] and results[1].finish_reason == "length"
    text = results[0].text
    stop = text[len(engine._loop.decode([65])):][:1] or text[-1:]
    stopped = engine.generate([GenerationRequest("s", "the quick", GenerationParams(max_new_tokens=5, stop=(stop,)))])[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text


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


def test_gptj_batches_only_prompts_of_one_length_together(fake_sdk, tmp_path):
    """GPT-J's graphs ignore start_ids (the fake too): mixed lengths would attend to padding, so the
    engine runs each prompt length apart, and each request still decodes to HF generate's tokens."""
    model_dir = make_checkpoint("gptj", tmp_path / "art")
    engine = _engine("gptj", batch=4)
    engine.load(model_dir, 0, 1)
    prompts = ["the quick brown fox jumps over", "hello", "a b c"]
    results = engine.generate([GenerationRequest(str(i), p, GenerationParams(max_new_tokens=6))
                               for i, p in enumerate(prompts)])
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model_dir, prompt, 6)
    prefills = [c for c in fake_sdk["GPTJForSampling"].calls if c[0] == "prefill"]
    assert all(set(starts) == {0} for _, _, starts in prefills)  # never any left padding


def test_mistral_sliding_window_counter_restarts_with_each_batch(monkeypatch, tmp_path):
    sdk = types.ModuleType("transformers_neuronx")
    sdk.MistralForSampling = type("MistralForSampling", (_FakeSampling,), {"calls": [], "num_processed_tokens": 0})
    monkeypatch.setitem(sys.modules, "transformers_neuronx", sdk)
    model_dir = make_checkpoint("mistral", tmp_path / "art")
    engine = _engine("mistral", batch=2)
    engine.load(model_dir, 0, 1)
    for _ in range(2):
        engine.generate([GenerationRequest("a", "the quick", GenerationParams(max_new_tokens=3))])
    assert [c[1] for c in sdk.MistralForSampling.calls if c[0] == "processed_at_prefill"] == [0, 0]
