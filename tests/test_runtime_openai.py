"""The OpenAI-compatible routes, driven by the `openai` Python client."""

import httpx
import pytest

from lmc.runtime.server import Runtime
from runtime_fakes import ServerThread, expected_text, fake_plan, write_artifact

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
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (3, 5, 8)
    assert reply.model == "fake/tiny" and reply.object == "text_completion"


def test_completion_for_a_list_of_prompts(client):
    reply = client.completions.create(model="x", prompt=["a b", "c d e"], max_tokens=2, temperature=0)
    assert [c.text for c in reply.choices] == [expected_text("a b", 2), expected_text("c d e", 2)]
    assert [c.index for c in reply.choices] == [0, 1]


def test_completion_stream(client):
    stream = client.completions.create(model="x", prompt="one two three", max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text("one two three", 4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_uses_the_artifact_template(client):
    reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hello world"}],
                                           max_tokens=3, temperature=0)
    # The fake engine echoes the rendered prompt's words reversed: the template's tokens show it was applied.
    assert reply.choices[0].message.content == expected_text("<user> hello world <assistant>", 3)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == 4


def test_chat_stream(client):
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected_text("<user> hi <assistant>", 5)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_errors_are_400_with_the_reason(client, server):
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model="x", prompt="a", n=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model="x", prompt="a", max_tokens=0)
    reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert reply.status_code == 400 and "messages must be a non-empty list" in reply.json()["error"]["message"]
