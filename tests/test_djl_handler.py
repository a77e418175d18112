"""The DJL Python-engine handler with fake Input objects and a fake engine. The answers go into lmc's
stand-in for djl_python.outputs.Output (djl_python is not installable here): these tests check the
handler's logic, not the real Output's wire format."""

from __future__ import annotations

import json
import threading

import pytest

from lmc.errors import ArtifactError
from lmc.runtime.djl import JSONLINES, DJLHandler
from lmc.runtime.engines.base import GenerationResult, Piece
from lmc.runtime.startup import verify_for_rank
from lmc.testing.checkpoints import tokenizer_json
from runtime_fakes import artifact_tokenizer, fake_plan, write_artifact

MODEL_DIR = None  # a model dir holding only the tiny checkpoints' tokenizer.json (set by _model_dir)


@pytest.fixture(autouse=True, scope="module")
def _model_dir(tmp_path_factory):
    global MODEL_DIR
    MODEL_DIR = tmp_path_factory.mktemp("djl-model")
    (MODEL_DIR / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")


class FakeInput:
    def __init__(self, body=None, batches=None, properties=None):
        self.body, self.batches, self.properties = body, batches, properties or {"model_dir": str(MODEL_DIR)}

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
    """Answers each prompt upper-cased, one character a token (id = the character's code point, log-probability
    -0.5); with `hold`, waits on that Event after streaming the first piece; `fail` (an exception) is raised
    before generating or, with `fail_after_first`, after the first piece."""

    max_sequence_length = 64
    every_rank_answers = False  # the handler sets it

    def __init__(self, fail=None, hold=None, fail_after_first=False):
        self.loaded, self.batches, self.fail, self.hold, self.fail_after_first = None, [], fail, hold, fail_after_first
        self.finished = threading.Event()

    def load(self, model_dir, rank, world_size):
        self.loaded = (str(model_dir), rank, world_size)

    def count_tokens(self, text):
        return len(text.split())

    def generate(self, batch, on_token=None, cancel_probe=None):
        self.batches.append(batch)
        if self.fail and not self.fail_after_first:
            raise self.fail
        results = []
        for r in batch:
            text = r.prompt.upper()[: r.params.max_new_tokens]
            for i, char in enumerate(text):
                if on_token is not None:
                    on_token(r.id, Piece(char, ord(char), -0.5, last=i == len(text) - 1))
                if i == 0 and self.fail:
                    raise self.fail
                if i == 0 and self.hold is not None:
                    assert self.hold.wait(10)
            logprobs = [(-0.5, ((ord(c), -0.5),)) for c in text] if r.params.logprobs is not None else None
            results.append(GenerationResult(r.id, text, 1, len(text), "length", [ord(c) for c in text], logprobs))
        self.finished.set()
        return results


def _json(output, index):
    return json.loads(output.content[index])


def test_warmup_loads_the_engine_once_with_the_env_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    engines = []
    handler = DJLHandler(lambda: engines.append(FakeEngine()) or engines[-1])
    assert handler.handle(FakeInput()) is None
    handler.handle(FakeInput({"inputs": "hi"}))
    assert len(engines) == 1 and engines[0].loaded == (str(MODEL_DIR), 0, 1)


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
    handler = DJLHandler(lambda: FakeEngine(fail=RuntimeError("CUDA out of memory")))
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
    # The fake engine's token ids are code points; their texts are what the artifact's tokenizer makes of them.
    tokens = [{"id": ord(c), "text": artifact_tokenizer().decode([ord(c)]), "log_prob": -0.5} for c in "ABC D"]
    assert [token["text"] for token in tokens] == ["^", "_", "`", "=", "a"]
    assert _json(output, 0) == {"generated_text": "ABC D", "details": {"finish_reason": "length", "generated_tokens": 5,
                                                                        "inputs": "abc def", "tokens": tokens}}
    assert _json(output, 1) == [{"generated_text": "X", "details": {
        "finish_reason": "length", "generated_tokens": 1, "inputs": "x",
        "tokens": [{"id": ord("X"), "text": artifact_tokenizer().decode([ord("X")]), "log_prob": -0.5}]}}]
    assert _json(output, 2) == {"generated_text": "PLAIN"}


def _lines(data: bytes) -> list[dict]:
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.decode().splitlines()]


def _expected_lines(text: str, prompt: str, details: bool = False) -> list[dict]:
    tokens = [{"token": {"id": ord(c), "text": c, "log_prob": -0.5}} for c in text]
    tokens[-1]["generated_text"] = text
    if details:
        tokens[-1]["details"] = {"finish_reason": "length", "generated_tokens": len(text), "inputs": prompt}
    return tokens


def test_a_lone_streaming_request_is_streamed_as_it_is_generated():
    hold = threading.Event()
    engine = FakeEngine(hold=hold)
    handler = DJLHandler(lambda: engine)
    output = handler.handle(FakeInput(batches=[FakeInput({"inputs": "abc", "stream": True,
                                                          "parameters": {"details": True}})]))
    assert output.properties["content-type"] == JSONLINES and output.content == {}
    assert engine.batches == []  # nothing runs until DJL reads the stream
    stream = output.stream_content
    first = json.loads(next(stream))
    assert first == {"token": {"id": ord("A"), "text": "A", "log_prob": -0.5}}
    assert not engine.finished.is_set()  # the first line came while the engine was still generating
    hold.set()
    rest = [json.loads(line) for line in stream]
    assert [first, *rest] == _expected_lines("ABC", "abc", details=True)
    assert output.stream_output_formatter is None  # the lines go out as they are, not in DJL's default wrapper


def test_a_streaming_request_batched_with_others_gets_its_lines_at_once():
    engine = FakeEngine()
    handler = DJLHandler(lambda: engine)
    output = handler.handle(FakeInput(batches=[FakeInput({"inputs": "ab", "stream": True}), FakeInput({"inputs": "cd"})]))
    assert len(engine.batches) == 1 and len(engine.batches[0]) == 2
    assert output.properties["batch_0_Content-Type"] == JSONLINES
    assert _lines(output.content[0]) == _expected_lines("AB", "ab")
    assert _json(output, 1) == {"generated_text": "CD"}


def test_a_failure_mid_stream_ends_it_with_an_error_line():
    handler = DJLHandler(lambda: FakeEngine(fail=RuntimeError("NCCL timeout"), fail_after_first=True))
    output = handler.handle(FakeInput({"inputs": "xyz", "stream": True}))
    lines = [json.loads(line) for line in output.stream_content]
    assert lines == [{"token": {"id": ord("X"), "text": "X", "log_prob": -0.5}},
                     {"error": "model failure: RuntimeError: NCCL timeout", "code": 424}]


def test_a_stream_whose_generation_dies_outside_exception_still_ends():
    """A BaseException (or a failing set_device) in the generation thread must still end the stream: DJL
    serves nothing else until it does."""
    handler = DJLHandler(lambda: FakeEngine(fail=SystemExit(3)))
    output = handler.handle(FakeInput({"inputs": "xyz", "stream": True}))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(json.loads(line) for line in output.stream_content), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and lines == [{"error": "model failure: SystemExit: 3", "code": 424}]


def test_streaming_a_list_of_inputs_is_a_400():
    handler = DJLHandler(lambda: FakeEngine())
    output = handler.handle(FakeInput(batches=[FakeInput({"inputs": ["a", "b"], "stream": True})]))
    assert output.stream_content is None
    assert _json(output, 0) == {"error": "stream = true takes a single string in inputs, not a list", "code": 400}


def test_with_verify_each_rank_checks_the_files_it_reads_before_loading(tmp_path, monkeypatch):
    """In DJL's MPI mode no lmc front end checked the artifact: the generated model.py asks each rank to.
    Rank 1's altered shard stops rank 1 before it loads (or joins torch.distributed), naming the file;
    rank 0 never opens that shard, so it does not hash it."""
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    shard = model / "shards/tp2/rank1.safetensors"
    shard.write_bytes(b"\xff" + shard.read_bytes()[1:])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    engine = FakeEngine()
    handler = DJLHandler(lambda: engine, verify=True)
    with pytest.raises(ArtifactError, match=r"shards/tp2/rank1\.safetensors: altered: sha256 differs"):
        handler.handle(FakeInput(properties={"model_dir": str(model)}))
    assert engine.loaded is None and handler.engine is None
    assert verify_for_rank(model, 0, 2)["plan"]["tensor_parallel_degree"] == 2
    with pytest.raises(ArtifactError, match=r"rank1\.safetensors: altered"):
        verify_for_rank(model, 0, 1)  # one process loads every shard: it checks them all


def test_with_verify_a_file_added_to_the_model_dir_stops_the_load(tmp_path, monkeypatch):
    model = write_artifact(tmp_path / "m", fake_plan())
    (model / "config.json.orig").write_text("{}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    engine = FakeEngine()
    with pytest.raises(ArtifactError, match=r"config\.json\.orig: not listed in lmc\.json"):
        DJLHandler(lambda: engine, verify=True).handle(FakeInput(properties={"model_dir": str(model)}))
    assert engine.loaded is None
    (model / "config.json.orig").unlink()
    DJLHandler(lambda: engine, verify=True).handle(FakeInput(properties={"model_dir": str(model)}))
    assert engine.loaded == (str(model), 0, 1)
