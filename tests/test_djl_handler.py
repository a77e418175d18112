"""The DJL Python-engine handler with fake Input objects and a fake engine. The answers go into lmc's
stand-in for djl_python.outputs.Output (djl_python is not installable here): these tests check the
handler's logic, not the real Output's wire format."""

from __future__ import annotations

import json

from lmc.runtime.djl import DJLHandler
from lmc.runtime.engines.base import GenerationResult


class FakeInput:
    def __init__(self, body=None, batches=None, properties=None):
        self.body, self.batches, self.properties = body, batches, properties or {"model_dir": "/models/x"}

    def is_empty(self):
        return self.body is None and not self.batches

    def get_properties(self):
        return self.properties

    def get_batches(self):
        return self.batches if self.batches is not None else [self]

    def get_as_json(self):
        if isinstance(self.body, Exception):
            raise self.body
        return self.body


class FakeEngine:
    max_sequence_length = 64

    def __init__(self, fail=False):
        self.loaded, self.batches, self.fail = None, [], fail

    def load(self, model_dir, rank, world_size):
        self.loaded = (str(model_dir), rank, world_size)

    def count_tokens(self, text):
        return len(text.split())

    def generate(self, batch, on_token=None):
        self.batches.append(batch)
        if self.fail:
            raise RuntimeError("CUDA out of memory")
        return [GenerationResult(r.id, r.prompt.upper()[: r.params.max_new_tokens], 1, 1, "length") for r in batch]


def _json(output, index):
    return json.loads(output.content[index])


def test_warmup_loads_the_engine_once_with_the_env_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    engines = []
    handler = DJLHandler(lambda: engines.append(FakeEngine()) or engines[-1])
    assert handler.handle(FakeInput()) is None
    handler.handle(FakeInput({"inputs": "hi"}))
    assert len(engines) == 1 and engines[0].loaded == ("/models/x", 0, 1)


def test_a_batch_is_generated_together_and_answered_per_index():
    engine = FakeEngine()
    handler = DJLHandler(lambda: engine)
    output = handler.handle(FakeInput(batches=[
        FakeInput({"inputs": "abc def", "parameters": {"max_new_tokens": 5}}),
        FakeInput({"inputs": ["x", "yz"]}),
        FakeInput({"inputs": "bad", "parameters": {"top_p": 3}}),
        FakeInput({"inputs": "word " * 70, "parameters": {"max_new_tokens": 4}}),
    ]))
    assert len(engine.batches) == 1 and len(engine.batches[0]) == 3  # one generate call; bad items left out
    assert _json(output, 0) == {"generated_text": "ABC D"}
    assert _json(output, 1) == [{"generated_text": "X"}, {"generated_text": "YZ"}]
    assert _json(output, 2) == {"error": "parameters.top_p must be in [0, 1], got 3", "code": 400}
    assert _json(output, 3)["code"] == 400
    assert "74 exceeds the maximum sequence length 64" in _json(output, 3)["error"]


def test_a_model_failure_fails_the_batch_with_424():
    handler = DJLHandler(lambda: FakeEngine(fail=True))
    output = handler.handle(FakeInput(batches=[FakeInput({"inputs": "a"}), FakeInput({"inputs": "b"})]))
    for index in (0, 1):
        assert _json(output, index) == {"error": "model failure: RuntimeError: CUDA out of memory", "code": 424}


def test_an_unreadable_body_is_a_400():
    handler = DJLHandler(lambda: FakeEngine())
    output = handler.handle(FakeInput(batches=[FakeInput(ValueError("Expecting value: line 1"))]))
    assert _json(output, 0) == {"error": "Expecting value: line 1", "code": 400}


def test_an_empty_prompt_fails_alone_not_its_batch():
    engine = FakeEngine()
    handler = DJLHandler(lambda: engine)
    output = handler.handle(FakeInput(batches=[FakeInput({"inputs": ""}), FakeInput({"inputs": "fine"})]))
    assert _json(output, 0) == {"error": "the prompt is empty after tokenization; give at least one token of input",
                                "code": 400}
    assert _json(output, 1) == {"generated_text": "FINE"}
    assert [r.prompt for r in engine.batches[0]] == ["fine"]


def test_details_are_added_when_asked_as_the_lmi_server_does():
    handler = DJLHandler(lambda: FakeEngine())
    output = handler.handle(FakeInput(batches=[
        FakeInput({"inputs": "abc def", "parameters": {"max_new_tokens": 5, "details": True}}),
        FakeInput({"inputs": ["x"], "parameters": {"details": True}}),
        FakeInput({"inputs": "plain"}),
    ]))
    assert _json(output, 0) == {"generated_text": "ABC D", "details": {"finish_reason": "length", "generated_tokens": 1,
                                                                        "inputs": "abc def"}}
    assert _json(output, 1) == [{"generated_text": "X", "details": {"finish_reason": "length", "generated_tokens": 1,
                                                                     "inputs": "x"}}]
    assert _json(output, 2) == {"generated_text": "PLAIN"}
