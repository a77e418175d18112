"""The OpenAI-compatible routes, driven by the `openai` Python client."""

import json

import httpx
import pytest

from lmc.runtime.server import Runtime
from runtime_fakes import ServerThread, expected_text, fake_plan, prompt_tokens, write_artifact

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    plan = fake_plan(model={"id": "fake/tiny"})
    model = write_artifact(tmp_path_factory.mktemp("oa") / "m", plan)
    with ServerThread(Runtime(model, plan, request_timeout_s=30)) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion(client):
    reply = client.completions.create(model="fake/tiny", prompt="red green blue", max_tokens=5, temperature=0)
    assert reply.choices[0].text == expected_text("red green blue", 5)
    assert reply.choices[0].finish_reason == "length"
    # counted by the artifact's tokenizer: 10 tokens, where a count of words would say 3
    assert prompt_tokens("red green blue") == 10
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (10, 5, 15)
    assert reply.model == "fake/tiny" and reply.object == "text_completion"


def test_completion_for_a_list_of_prompts(client):
    reply = client.completions.create(model="fake/tiny", prompt=["a b", "c d e"], max_tokens=2, temperature=0)
    assert [c.text for c in reply.choices] == [expected_text("a b", 2), expected_text("c d e", 2)]
    assert [c.index for c in reply.choices] == [0, 1]


def test_completion_stream(client):
    stream = client.completions.create(model="fake/tiny", prompt="one two three", max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text("one two three", 4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_uses_the_artifact_template(client):
    reply = client.chat.completions.create(model="fake/tiny", messages=[{"role": "user", "content": "hello world"}],
                                           max_tokens=3, temperature=0)
    # The fake engine echoes the rendered prompt's words reversed: the template's tokens show it was applied.
    assert reply.choices[0].message.content == expected_text("<user> hello world <assistant>", 3)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == prompt_tokens("<user> hello world <assistant>") == 22


def test_chat_stream(client):
    stream = client.chat.completions.create(model="fake/tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected_text("<user> hi <assistant>", 5)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_gives_n_choices_in_openai_order_counting_each_prompt_once(client):
    reply = client.completions.create(model="fake/tiny", prompt=["a b", "c d e"], max_tokens=2, n=2, temperature=0)
    assert [(c.index, c.text) for c in reply.choices] == [
        (0, expected_text("a b", 2)), (1, expected_text("a b", 2)), (2, expected_text("c d e", 2)),
        (3, expected_text("c d e", 2))]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens("a b") + prompt_tokens("c d e"), 8)
    chat = client.chat.completions.create(model="fake/tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.prompt_tokens == prompt_tokens("<user> hi <assistant>") == 16


def test_n_choices_stream_side_by_side_each_with_its_index_and_finish(client):
    stream = client.completions.create(model="fake/tiny", prompt="one two", max_tokens=3, n=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts, finishes = {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        [choice] = c.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            assert choice.index not in finishes  # one finish per choice, and nothing after it
            finishes[choice.index] = choice.finish_reason
        else:
            assert choice.index not in finishes
    assert texts == {0: expected_text("one two", 3), 1: expected_text("one two", 3)}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens("one two"), 6)
    chat = list(client.chat.completions.create(model="fake/tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                               n=3, temperature=0, stream=True))
    assert [c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant"] == [0, 1, 2]
    for index in range(3):
        mine = [c.choices[0] for c in chat if c.choices[0].index == index]
        assert "".join(choice.delta.content or "" for choice in mine) == expected_text("<user> hi <assistant>", 2)
        assert mine[-1].finish_reason == "length"


def test_a_failure_in_one_of_n_streamed_choices_ends_the_stream_with_the_error(server):
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "RAISE", "max_tokens": 2, "n": 2, "stream": True})
    events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["error"]["code"] == 424
    assert events[-1] == "data: [DONE]" and len(events) == 2


def test_when_one_of_n_streamed_choices_fails_the_others_are_given_up_at_once(tmp_path):
    """Choice 0 (seed 7) fails in its batch; choices 1 and 2, queued or decoding behind it (batch_size 1, 0.5 s
    a token), are given up when the error ends the stream, not left to run to their end."""
    import time

    plan = fake_plan(batch_size=1, max_batch_delay_ms=0)
    runtime = Runtime(write_artifact(tmp_path / "m", plan, {"step_delay_s": 0.5}), plan, request_timeout_s=30)
    abandoned = {}
    original = runtime.scheduler.abandon

    def abandon(job):
        abandoned.setdefault(job.request.params.seed, time.monotonic())
        original(job)

    runtime.scheduler.abandon = abandon
    with ServerThread(runtime) as server:
        server.wait_ready()
        reply = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "prompt": "RAISE@7 x", "n": 3, "seed": 7, "max_tokens": 4, "temperature": 1, "stream": True})
        ended = time.monotonic()
        events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == 424 and events[-1] == "data: [DONE]"
        time.sleep(0.3)
        assert set(abandoned) == {7, 8, 9}
        assert all(at - ended < 0.3 for at in abandoned.values())  # not after their 2 s of decoding
        assert runtime._in_flight == 0


def test_each_prompt_is_tokenized_once_whatever_n(server, monkeypatch):
    """Tokenizing holds the event loop: n copies of a prompt, and chat's default answer length, reuse
    one count per prompt."""
    text = server.runtime.text
    counted = []
    real = text.count_tokens
    monkeypatch.setattr(text, "count_tokens", lambda prompts, special=True: counted.extend(prompts) or real(prompts, special))
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi there"}], "n": 3})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 3, reply.text
    assert len(counted) == 1
    counted.clear()
    reply = httpx.post(server.url + "/v1/completions", timeout=30, json={"prompt": ["a b", "c"], "n": 2, "max_tokens": 2})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 4, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == prompt_tokens("a b") + prompt_tokens("c")
    assert counted == ["a b", "c"]


def test_n_copies_sample_with_distinct_seeds(tmp_path):
    """One seed for n copies would give n identical samples: copy i gets seed + i (reproducible as a whole)."""
    from lmc.runtime.engines.base import GenerationParams
    from lmc.runtime.openai_api import _make_jobs

    plan = fake_plan()
    runtime = Runtime(write_artifact(tmp_path / "m", plan), plan, request_timeout_s=30)
    jobs = _make_jobs(runtime, ["p q", "r"], [2, 1], GenerationParams(do_sample=True, seed=7), 3, False, "prompt")
    assert [(job.request.prompt, job.request.params.seed) for job in jobs] == [
        ("p q", 7), ("p q", 8), ("p q", 9), ("r", 7), ("r", 8), ("r", 9)]
    unseeded = _make_jobs(runtime, ["p"], [1], GenerationParams(do_sample=True), 2, False, "prompt")
    assert [job.request.params.seed for job in unseeded] == [None, None]  # each row draws its own
    with pytest.raises(Exception, match="n = 9 for 2 prompt\\(s\\) is 18 answers; the request queue holds 16"):
        _make_jobs(runtime, ["a", "b"], [1, 1], GenerationParams(), 9, False, "prompt")


def test_models_lists_the_served_model_for_clients_that_discover_it(client, server):
    [model] = client.models.list().data
    assert (model.id, model.object, model.owned_by) == ("fake/tiny", "model", "lmc")
    assert model.model_extra["max_model_len"] == 64
    health = httpx.get(server.url + "/health")
    assert (health.status_code, health.json()) == (200, {"status": "healthy"})


def test_a_failure_mid_stream_sends_the_error_then_done(server):
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "RAISE", "max_tokens": 2, "stream": True})
    events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["error"]["code"] == 424
    assert events[-1] == "data: [DONE]"


def test_logprobs_zero_is_on_and_the_sampled_token_is_always_among_the_alternatives():
    from types import SimpleNamespace

    from lmc.runtime.engines.base import GenerationResult
    from lmc.runtime.openai_api import _choice_logprobs, _logprobs

    assert _logprobs({"logprobs": 0}, chat=False) == 0 and _logprobs({"logprobs": False}, chat=False) is None
    runtime = SimpleNamespace(text=SimpleNamespace(token_text=lambda token: f"<{token}>"))
    sampled = GenerationResult("r", "x", 1, 2, "length", token_ids=[5, 1], logprobs=[(-3.0, ((1, -0.1),)), (-0.2, ((1, -0.2),))])
    assert _choice_logprobs(runtime, sampled, chat=False) == {
        "tokens": ["<5>", "<1>"], "token_logprobs": [-3.0, -0.2], "text_offset": [0, 3],
        "top_logprobs": [{"<1>": -0.1, "<5>": -3.0}, {"<1>": -0.2}]}


def test_message_names_reach_the_template():
    from lmc.runtime.openai_api import _messages

    body = {"messages": [{"role": "user", "name": "ann", "content": "hi"}, {"role": "assistant", "content": None}]}
    assert _messages(body) == [{"role": "user", "name": "ann", "content": "hi"}, {"role": "assistant", "content": ""}]


def test_openai_errors_are_400_with_the_reason(client, server):
    with pytest.raises(openai.BadRequestError, match="n must be a positive integer, got 0"):
        client.completions.create(model="fake/tiny", prompt="a", n=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model="fake/tiny", prompt="a", max_tokens=0)
    reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert reply.status_code == 400 and "messages must be a non-empty list" in reply.json()["error"]["message"]
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "add_special_tokens": "yes"})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "add_special_tokens must be true or false"
    # Fields that would change the answer are refused rather than dropped (a JSON-mode request must not get free text).
    for field, message in [({"response_format": {"type": "json_object"}}, "response_format: only"),
                            ({"best_of": 3}, "best_of must be 1 (or equal to n)"),
                            ({"suffix": "end"}, "suffix is not supported"),
                            ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]")]:
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "a", **field})
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(message), reply.text
    for path, field, message in [
            ("completions", {"logprobs": 21}, "logprobs must be an integer in [0, 20], got 21"),
            ("completions", {"top_logprobs": 2}, "top_logprobs is a chat field; completions take logprobs = k"),
            ("chat/completions", {"logprobs": 3}, "logprobs must be true or false"),
            ("chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs = true")]:
        body = {"messages": [{"role": "user", "content": "a"}]} if path.startswith("chat") else {"prompt": "a"}
        reply = httpx.post(server.url + f"/v1/{path}", json={**body, **field})
        assert reply.status_code == 400 and reply.json()["error"]["message"] == message, reply.text
    chat = {"messages": [{"role": "user", "content": "a"}]}
    for path, body, message in [
            # True == 1 and 0 == False in Python: JSON's types must still be told apart.
            ("completions", {"prompt": "a", "best_of": True}, "best_of must be 1 (or equal to n)"),
            ("completions", {"prompt": "a", "echo": 0}, "echo is not supported"),
            # The other route's input field would be silently ignored: refused like any unknown field.
            ("completions", {"prompt": "a", **chat}, "unsupported field 'messages'"),
            ("chat/completions", {**chat, "prompt": "a"}, "unsupported field 'prompt'"),
            # An integer past a float's range: a 400, not an OverflowError's 500.
            ("completions", {"prompt": "a", "temperature": 10**400}, "temperature must be in [0, 100], got an integer"),
            ("chat/completions", {**chat, "presence_penalty": -10**400}, "presence_penalty must be in [-2, 2]"),
            # Length errors name the OpenAI field.
            ("completions", {"prompt": "a " * 40, "max_tokens": 40}, "prompt has ")]:
        reply = httpx.post(server.url + f"/v1/{path}", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(message), reply.text
        if path == "completions" and "max_tokens" in body:
            assert "with max_tokens = 40" in reply.json()["error"]["message"], reply.text
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1, "response_format": {"type": "text"},
                                                          "best_of": 1, "presence_penalty": 0.5, "logit_bias": {"3": 1},
                                                          "stream": None, "echo": None})
    assert ok.status_code == 200 and ok.json()["object"] == "text_completion", ok.text
    ok = httpx.post(server.url + "/v1/chat/completions", json={**chat, "max_tokens": 1, "stream": None})
    assert ok.status_code == 200 and ok.json()["object"] == "chat.completion", ok.text


def test_logit_bias_ids_are_checked_against_the_tokenizer(tmp_path):
    import shutil

    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    (tmp_path / "m").mkdir()
    shutil.copy(checkpoint / "tokenizer.json", tmp_path / "m" / "tokenizer.json")
    plan = fake_plan()
    model = write_artifact(tmp_path / "m", plan)
    runtime = Runtime(model, plan, request_timeout_s=30)
    vocab = runtime.text.vocab_size
    assert vocab and vocab > 10
    with ServerThread(runtime) as srv:
        srv.wait_ready()
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "logit_bias": {str(vocab): 5, "1": 1}})
        good = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                             "logit_bias": {str(vocab - 1): 5}})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == f"logit_bias names token id {vocab}; the vocabulary has ids 0-{vocab - 1}"
    assert good.status_code == 200


GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7,
                     "repetition_penalty": None, "eos_token_id": 2}


def _recorded(record_dir) -> list[dict]:
    lines = (record_dir / "batches.jsonl").read_text().splitlines()
    (record_dir / "batches.jsonl").unlink()
    import json

    return [params for line in lines for params in json.loads(line)["params"]]


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_generation_config_sets_the_openai_defaults(tmp_path, mode):
    """As in vLLM: the model's generation_config.json fills the sampling fields a request leaves out on the
    OpenAI routes (chat's max_tokens too); what the request sets wins; /invocations keeps the LMI defaults."""
    import json

    from lmc.runtime.startup import sampling_defaults

    record = tmp_path / "record"
    record.mkdir()
    plan = fake_plan()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    model = write_artifact(tmp_path / "m", plan, engine_kwargs={"record_dir": str(record)})
    defaults = sampling_defaults(model) if mode == "auto" else {}
    with ServerThread(Runtime(model, plan, request_timeout_s=30, sampling_defaults=defaults)) as srv:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="fake/tiny", messages=[{"role": "user", "content": "hi"}])
        client.completions.create(model="fake/tiny", prompt="a b", top_p=0.5)
        client.completions.create(model="fake/tiny", prompt="a b", temperature=0, max_tokens=3)
        httpx.post(srv.url + "/invocations", json={"inputs": "a b"}).raise_for_status()
        chat, completion, greedy, lmi = _recorded(record)
    if mode == "auto":
        assert chat == {"max_new_tokens": 7, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                        "repetition_penalty": 1.0}
        assert completion == dict(chat, max_new_tokens=16, top_p=0.5)
    else:
        # 64 positions less the rendered prompt's 16 tokens
        assert chat == {"max_new_tokens": 64 - prompt_tokens("<user> hi <assistant>"), "do_sample": True,
                        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
        assert completion == dict(chat, max_new_tokens=16, top_p=0.5)
    assert greedy["do_sample"] is False and greedy["max_new_tokens"] == 3
    assert lmi == {"max_new_tokens": 32, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                   "repetition_penalty": 1.0}


@pytest.mark.parametrize("spec, expected", [({"workload": {"max_output_tokens": 100}}, 100), ({}, 1024 - 16)],
                         ids=["planned-output", "no-workload-recorded"])
def test_chat_without_max_tokens_gets_the_planned_answer_length(tmp_path, spec, expected):
    """The spec's max_output_tokens (what batches and the KV cache were planned for), within what the
    sequence length leaves; an artifact that records no workload gets all the room (vLLM's default)."""
    record = tmp_path / "record"
    record.mkdir()
    plan = fake_plan(max_sequence_length=1024)
    model = write_artifact(tmp_path / "m", plan, engine_kwargs={"record_dir": str(record)}, spec=spec)
    with ServerThread(Runtime(model, plan, request_timeout_s=30)) as srv:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="fake/tiny", messages=[{"role": "user", "content": "hi"}], temperature=0)
    [chat] = _recorded(record)
    assert prompt_tokens("<user> hi <assistant>") == 16  # the rendered prompt, as the artifact's tokenizer counts it
    assert chat["max_new_tokens"] == reply.usage.completion_tokens == expected


def test_chat_min_tokens_without_max_tokens_gets_room_for_them(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    plan = fake_plan(max_sequence_length=1024)
    model = write_artifact(tmp_path / "m", plan, engine_kwargs={"record_dir": str(record)},
                           spec={"workload": {"max_output_tokens": 100}})
    with ServerThread(Runtime(model, plan, request_timeout_s=30)) as srv:
        srv.wait_ready()
        reply = httpx.post(srv.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}], "min_tokens": 300})
    assert reply.status_code == 200, reply.text
    assert [params["max_new_tokens"] for params in _recorded(record)] == [300]


def test_sampling_defaults_skip_values_the_parser_refuses(tmp_path, caplog):
    import json

    from lmc.runtime.startup import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 1.5, "top_k": "40", "repetition_penalty": 1.1, "do_sample": False,
         "max_length": 4096}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "repetition_penalty": 1.1}
    assert "top_p = 1.5" in caplog.text and "top_k = '40'" in caplog.text
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 10**400, "top_p": 0.9}))
    assert sampling_defaults(tmp_path) == {"top_p": 0.9}  # past a float's range: skipped, not a crash at start
    assert "temperature must be in [0, 100], got an integer of 401 digits" in caplog.text
    assert sampling_defaults(tmp_path / "absent") == {}
