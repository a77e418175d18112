"""The HTTP front end against real worker processes running the fake engine (TP=1)."""

import asyncio
import re
import contextlib
import json
import threading
import time

import httpx
import pytest

from lmc.runtime.server import Runtime
from runtime_fakes import ServerThread, expected_text, fake_plan, prompt_tokens, wait_in_flight, write_artifact

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def serve_fake(root, plan_overrides=None, engine_kwargs=None, wait=True, **runtime_kwargs):
    plan = fake_plan(**(plan_overrides or {}))
    model = write_artifact(root, plan, engine_kwargs)
    runtime_kwargs.setdefault("request_timeout_s", 30.0)
    with ServerThread(Runtime(model, plan, **runtime_kwargs)) as server:
        if wait:
            server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    record = root / "record"
    record.mkdir()
    with serve_fake(root / "model", {"batch_size": 8, "job_queue_size": 128, "max_batch_delay_ms": 30},
                    {"step_delay_s": 0.002, "record_dir": str(record)}, max_body_bytes=64 * 1024) as srv:
        srv.record = record
        yield srv


def post(server, body, path="/invocations", **kw):
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def test_ping_is_503_while_loading_then_200(tmp_path):
    with serve_fake(tmp_path / "m", engine_kwargs={"load_delay_s": 1.5}, wait=False) as srv:
        first = httpx.get(srv.url + "/ping")
        assert first.status_code == 503
        assert "loading" in first.json()["reason"]
        srv.wait_ready(30)
        assert httpx.get(srv.url + "/ping").json() == {"status": "healthy"}


def test_string_input_gives_one_object(server):
    reply = post(server, {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 5}})
    assert reply.status_code == 200
    assert reply.json() == {"generated_text": expected_text("the quick brown fox", 5)}


def test_list_input_gives_a_list_in_order(server):
    prompts = ["one two", "three four five", "six"]
    reply = post(server, {"inputs": prompts, "parameters": {"max_new_tokens": 4}})
    assert reply.status_code == 200
    assert reply.json() == [{"generated_text": expected_text(p, 4)} for p in prompts]


def test_stream_is_jsonlines_token_by_token_then_the_text(server):
    reply = post(server, {"inputs": "alpha beta gamma", "parameters": {"max_new_tokens": 6}, "stream": True})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("application/jsonlines")
    lines = [json.loads(line) for line in reply.text.splitlines()]
    tokens = [line["token"]["text"] for line in lines]  # LMI: the last line is a token line too
    assert len(tokens) == 7 and tokens[-1] == ""  # the fake engine does not mark its last piece
    assert "".join(tokens) == lines[-1]["generated_text"] == expected_text("alpha beta gamma", 6)
    assert all(set(line) == {"token"} for line in lines[:-1])
    assert set(lines[-1]) == {"token", "generated_text"}  # details only when asked, as LMI
    detailed = post(server, {"inputs": "alpha beta gamma", "parameters": {"max_new_tokens": 6, "details": True},
                             "stream": True})
    lines = [json.loads(line) for line in detailed.text.splitlines()]
    assert all(set(line) == {"token"} for line in lines[:-1])
    assert lines[-1]["details"] == {"finish_reason": "length", "generated_tokens": 6, "inputs": "alpha beta gamma"}


def test_details_on_request_as_lmi_documents(server):
    reply = post(server, {"inputs": ["a b", "c"], "parameters": {"max_new_tokens": 2, "details": True}})
    assert reply.json() == [
        {"generated_text": expected_text("a b", 2), "details": {"finish_reason": "length", "generated_tokens": 2,
                                                                "inputs": "a b"}},
        {"generated_text": expected_text("c", 2), "details": {"finish_reason": "length", "generated_tokens": 2,
                                                              "inputs": "c"}}]


@pytest.mark.parametrize("engine_reason, lmi_reason", [("length", "length"), ("eos", "eos_token"),
                                                       ("stop", "stop_sequence")])
def test_finish_reasons_use_lmi_names(engine_reason, lmi_reason):
    from lmc.runtime.engines.base import GenerationResult
    from lmc.runtime.requests import lmi_details

    result = GenerationResult(id="r", text="x", prompt_tokens=2, generated_tokens=1, finish_reason=engine_reason)
    assert lmi_details("the prompt", result) == {"finish_reason": lmi_reason, "generated_tokens": 1,
                                                 "inputs": "the prompt"}


@pytest.mark.parametrize("body,reason", [
    (b"{not json", "malformed JSON body"),
    (b'{"parameters": {}}', "no 'inputs'"),
    (b'{"inputs": 42}', "inputs must be a string or a list of strings, got a number"),
    (b'{"inputs": ["a", 3]}', r"inputs\[1\] must be a string"),
    (b'{"inputs": "a", "parameters": {"max_new_tokens": "5"}}', "max_new_tokens must be an integer"),
    (b'{"inputs": "a", "stream": "yes"}', "stream must be true or false"),
    (b'{"inputs": ["a", "b"], "stream": true}', "takes a single string"),
    # the artifact's tokenizer makes 10 tokens of these 3 words (3 + 60 would fit)
    (b'{"inputs": "red green blue", "parameters": {"max_new_tokens": 60}}',
     "has 10 prompt tokens; with max_new_tokens = 60 that is 70, beyond the maximum sequence length 64"),
    (b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", "malformed JSON body: maximum recursion depth"),
    (b'{"inputs": "a", "parameters": {"seed": ' + b"1" * 5000 + b"}}", "malformed JSON body: Exceeds the limit"),
    (b'{"inputs": "a \\ud800 b"}', "lone UTF-16 surrogate"),
    (b'{"inputs": ["fine", ""]}', r"inputs\[1\] is empty after tokenization"),
    (json.dumps({"inputs": ["p"] * 129}).encode(), "129 prompts; the request queue holds 128: send at most 128"),
])
def test_bad_requests_are_400_with_the_reason(server, body, reason):
    reply = httpx.post(server.url + "/invocations", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["code"] == 400
    assert re.search(reason, reply.json()["error"]), reply.json()


def test_oversized_body_is_413_with_or_without_content_length(server):
    big = json.dumps({"inputs": "x " * 40_000}).encode()
    reply = httpx.post(server.url + "/invocations", content=big)
    assert reply.status_code == 413 and "limit is 65536" in reply.json()["error"]

    def chunks():
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    reply = httpx.post(server.url + "/invocations", content=chunks())
    assert reply.status_code == 413 and "exceeds the limit of 65536 bytes" in reply.json()["error"]
    # The limit passed by the body's last part: answered at once (nothing is left to discard; waiting for
    # more would wait for the client's disconnect).
    reply = httpx.post(server.url + "/invocations", content=iter([b" " * 60_000, b" " * 10_000]), timeout=10)
    assert reply.status_code == 413


def test_unknown_route_is_json_404(server):
    reply = httpx.get(server.url + "/nope")
    assert reply.status_code == 404 and reply.json()["code"] == 404


def test_wrong_method_is_json_405_with_allow(server):
    reply = httpx.get(server.url + "/invocations")
    assert reply.status_code == 405 and reply.json()["code"] == 405
    assert reply.headers["allow"] == "POST"  # RFC 9110: a 405 names the methods the route takes
    reply = httpx.delete(server.url + "/ping")
    assert reply.status_code == 405 and set(reply.headers["allow"].split(", ")) == {"GET", "HEAD"}


def test_a_huge_integer_parameter_is_a_400_not_a_500(server):
    reply = httpx.post(server.url + "/invocations", content=b'{"inputs": "a", "parameters": {"top_p": 1' + b"0" * 400 + b"}}")
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == "parameters.top_p must be in [0, 1], got an integer of 401 digits"


def test_a_long_prompt_is_tokenized_off_the_event_loop(server, monkeypatch):
    """Tokenizing takes about a second per megabyte of prompt: long prompts are counted on a thread, so
    /ping (and every other request) is answered meanwhile. Here the tokenizer holds a long prompt until
    /ping has been answered: counted on the event loop, /ping would time out instead."""
    from concurrent.futures import ThreadPoolExecutor

    from lmc.runtime.server import INLINE_TOKENIZE_CHARS

    text = server.runtime.text
    real = text.count_tokens
    counting, pinged = threading.Event(), threading.Event()

    def count(prompts, special=True):
        if sum(map(len, prompts)) > INLINE_TOKENIZE_CHARS:
            counting.set()
            pinged.wait(10)
        return real(prompts, special)

    monkeypatch.setattr(text, "count_tokens", count)
    prompt = "lorem " + "x" * INLINE_TOKENIZE_CHARS
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, server, {"inputs": prompt, "parameters": {"max_new_tokens": 3}})
        assert counting.wait(10)
        try:
            ping = httpx.get(server.url + "/ping", timeout=3).status_code
        except httpx.TimeoutException:
            ping = "timed out"
        finally:
            pinged.set()
        assert ping == 200
        # counted, then refused: far beyond the 64 positions (the tokenizer makes ~2 characters a token)
        assert reply.result().json()["error"] == (f"inputs has {prompt_tokens(prompt)} prompt tokens; with max_new_tokens = "
                                                  f"3 that is {prompt_tokens(prompt) + 3}, beyond the maximum sequence length 64")


def test_64_concurrent_clients_are_all_answered_and_batched(server):
    batches_file = server.record / "batches.jsonl"
    before = len(batches_file.read_text().splitlines()) if batches_file.exists() else 0

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i):
                prompt = f"client {i} says hello"
                reply = await client.post(server.url + "/invocations",
                                          json={"inputs": prompt, "parameters": {"max_new_tokens": 8}})
                return reply.status_code, reply.json(), prompt
            return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(main())
    assert [status for status, _, _ in results] == [200] * 64
    for _, body, prompt in results:
        assert body == {"generated_text": expected_text(prompt, 8)}
    sizes = [json.loads(line)["size"] for line in batches_file.read_text().splitlines()[before:]]
    assert sum(sizes) == 64
    assert max(sizes) == 8 and len(sizes) < 20, sizes  # batched, not one by one


def test_model_failure_is_424_and_service_continues(server):
    reply = post(server, {"inputs": "please RAISE now", "parameters": {"max_new_tokens": 2}})
    assert reply.status_code == 424
    assert "model failure: RuntimeError: fake failure requested by the prompt" in reply.json()["error"]
    assert post(server, {"inputs": "fine", "parameters": {"max_new_tokens": 2}}).status_code == 200


def _counter(text: str, prefix: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_metrics_expose_the_series(server):
    before = httpx.get(server.url + "/metrics").text
    post(server, {"inputs": "count me", "parameters": {"max_new_tokens": 3}})
    text = httpx.get(server.url + "/metrics").text
    ok = 'lmc_requests_total{endpoint="invocations",status="200"}'
    assert _counter(text, ok) - _counter(before, ok) == 1
    assert _counter(text, "lmc_generated_tokens_total") - _counter(before, "lmc_generated_tokens_total") == 3
    for series in ("lmc_queue_depth", "lmc_batch_size_bucket", "lmc_request_latency_seconds_bucket",
                   "lmc_time_to_first_token_seconds_bucket", "lmc_generated_tokens_total",
                   "lmc_worker_groups_ready 1.0"):
        assert series in text
    ok = [line for line in text.splitlines() if line.startswith('lmc_requests_total{endpoint="invocations",status="200"}')]
    assert ok and float(ok[0].split()[-1]) >= 1
    generated = [line for line in text.splitlines() if line.startswith("lmc_generated_tokens_total")]
    assert float(generated[0].split()[-1]) >= 3


@pytest.mark.parametrize("scheduling", ["dynamic", "continuous"])
def test_full_queue_answers_503_at_once_then_serves_again(tmp_path, scheduling):
    plan = {"batch_size": 1, "job_queue_size": 2, "max_batch_delay_ms": 0, "scheduling": scheduling}
    with serve_fake(tmp_path / "m", plan, {"step_delay_s": 0.05}) as srv:
        async def main():
            async with httpx.AsyncClient(timeout=30) as client:
                async def one(i):
                    start = time.monotonic()
                    reply = await client.post(srv.url + "/invocations",
                                              json={"inputs": f"p{i}", "parameters": {"max_new_tokens": 10}})
                    return reply.status_code, reply.json(), time.monotonic() - start
                return await asyncio.gather(*(one(i) for i in range(8)))

        results = asyncio.run(main())
        refused = [r for r in results if r[0] == 503]
        served = [r for r in results if r[0] == 200]
        assert refused and served and len(refused) + len(served) == 8
        assert all("queue is full" in body["error"] for _, body, _ in refused)
        # At once: every refusal came back before any admitted request finished (each decodes 10
        # steps of 50 ms), whatever the machine's speed.
        assert max(elapsed for _, _, elapsed in refused) < min(elapsed for _, _, elapsed in served)
        assert post(srv, {"inputs": "after", "parameters": {"max_new_tokens": 2}}).status_code == 200


def _finished(record, deadline_s: float = 10.0) -> list[dict]:
    """The fake engine's finished.jsonl lines, once there are some (rank 0's)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        path = record / "finished.jsonl"
        if path.exists() and path.read_text().strip():
            return [json.loads(line) for line in path.read_text().splitlines() if json.loads(line)["rank"] == 0]
        time.sleep(0.05)
    return []


@pytest.mark.parametrize("scheduling", ["dynamic", "continuous"])
def test_request_timeout_is_424_and_stops_its_row(tmp_path, scheduling):
    record = tmp_path / "record"
    record.mkdir()
    with serve_fake(tmp_path / "m", {"scheduling": scheduling}, {"step_delay_s": 0.6, "record_dir": str(record)},
                    request_timeout_s=0.5) as srv:
        start = time.time()
        reply = post(srv, {"inputs": "slow", "parameters": {"max_new_tokens": 20}})
        assert reply.status_code == 424 and "timed out after 0.5s" in reply.json()["error"]
        assert time.time() - start < 20 * 0.6  # answered before the generation itself could end
        # and the group did not decode the other tokens nobody would read
        [row] = _finished(record)
        assert row["finish_reason"] == "cancelled" and row["generated_tokens"] < 20
        assert row["at"] - start < 20 * 0.6 * 0.25
        # its first token came after the timeout: no time-to-first-token was observed for it
        assert "lmc_time_to_first_token_seconds_count 0.0" in httpx.get(srv.url + "/metrics").text


@pytest.mark.parametrize("path, body", [
    # 7 prompt tokens and 50 new: within the 64 positions
    ("/invocations", {"inputs": "gave up", "parameters": {"max_new_tokens": 50}}),
    ("/v1/completions", {"prompt": "gave up", "max_tokens": 50, "n": 2}),
], ids=["invocations", "openai-n2"])
def test_a_client_that_gives_up_on_a_whole_answer_stops_its_rows(tmp_path, path, body, caplog):
    import gc

    record = tmp_path / "record"
    record.mkdir()
    with serve_fake(tmp_path / "m", engine_kwargs={"step_delay_s": 0.1, "record_dir": str(record)}) as srv:
        start = time.time()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + path, json=body, timeout=0.5)
        rows = _finished(record)
        assert rows and all(row["finish_reason"] == "cancelled" and row["generated_tokens"] < 50 for row in rows)
        assert all(row["at"] - start < 50 * 0.1 * 0.5 for row in rows)
        metrics = httpx.get(srv.url + "/metrics").text
        endpoint = path.strip("/").replace("/", "_").removeprefix("v1_")
        assert f'lmc_requests_total{{endpoint="{endpoint}",status="499"}} 1.0' in metrics, metrics
        assert "lmc_requests_in_flight 0.0" in metrics
        gc.collect()
        assert "exception was never retrieved" not in caplog.text  # no traceback in the log per hang-up


def test_a_stream_the_client_drops_stops_its_row(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    with serve_fake(tmp_path / "m", engine_kwargs={"step_delay_s": 0.1, "record_dir": str(record)}) as srv:
        start = time.time()
        with httpx.stream("POST", srv.url + "/invocations", timeout=30,
                          json={"inputs": "drop me", "parameters": {"max_new_tokens": 50}, "stream": True}) as reply:
            next(reply.iter_lines())
        [row] = _finished(record)
        assert row["finish_reason"] == "cancelled" and row["generated_tokens"] < 50
        assert row["at"] - start < 50 * 0.1 * 0.5  # not after the 5 s the whole answer takes
        assert post(srv, {"inputs": "next one", "parameters": {"max_new_tokens": 3}}).json() == {
            "generated_text": expected_text("next one", 3)}


@pytest.mark.parametrize("path, body", [
    ("/invocations", {"inputs": "never mind", "parameters": {"max_new_tokens": 5}, "stream": True}),
    ("/v1/completions", {"prompt": "never mind", "max_tokens": 5, "stream": True}),
], ids=["jsonlines", "sse"])
def test_a_stream_dropped_while_queued_is_given_up_before_it_runs(tmp_path, path, body):
    record = tmp_path / "record"
    record.mkdir()
    with serve_fake(tmp_path / "m", engine_kwargs={"step_delay_s": 0.1, "record_dir": str(record)}) as srv:
        busy = threading.Thread(target=post, args=(srv, {"inputs": "busy", "parameters": {"max_new_tokens": 30}}))
        busy.start()  # holds the one worker group for 3 s
        time.sleep(0.3)
        with httpx.stream("POST", srv.url + path, json=body, timeout=30) as reply:
            assert reply.status_code == 200  # the headers came; no token will before the busy one ends
        deadline = time.monotonic() + 2
        while "499" not in (metrics := httpx.get(srv.url + "/metrics").text) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy.is_alive(), "the busy request ended first: nothing was checked"
        endpoint = path.strip("/").replace("/", "_").removeprefix("v1_")
        assert f'lmc_requests_total{{endpoint="{endpoint}",status="499"}} 1.0' in metrics
        busy.join(30)
        # Only the busy request ever ran: the dropped one left the queue with its client.
        assert [row["generated_tokens"] for row in _finished(record)] == [30]


def test_a_client_that_hangs_up_mid_body_is_recorded_as_499_not_400(server):
    import socket
    from urllib.parse import urlsplit

    def count(status):
        text = httpx.get(server.url + "/metrics").text
        lines = [l for l in text.splitlines() if l.startswith(f'lmc_requests_total{{endpoint="invocations",status="{status}"}}')]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = count(499), count(400)
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"inputs\": ")
        time.sleep(0.2)  # the handler is reading the body
    deadline = time.monotonic() + 10
    while count(499) == before[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (count(499), count(400)) == (before[0] + 1, before[1])


def test_a_stream_the_client_drops_is_recorded_as_499_and_releases_its_slot(server):
    def count(text, status):
        lines = [l for l in text.splitlines() if l.startswith(f'lmc_requests_total{{endpoint="invocations",status="{status}"}}')]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = count(httpx.get(server.url + "/metrics").text, 499)
    with httpx.stream("POST", server.url + "/invocations", timeout=30,
                      json={"inputs": "drop me", "parameters": {"max_new_tokens": 50}, "stream": True}) as reply:
        next(reply.iter_lines())  # the first piece arrived; hang up mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        if count(text, 499) > before:
            break
        time.sleep(0.05)
    assert count(text, 499) == before + 1
    assert "lmc_requests_in_flight 0.0" in text


def _rank_pids(record, rank: int) -> list[int]:
    return [int(path.read_text()) for path in record.glob(f"rank{rank}.*.pid")]


def test_a_frozen_rank_0_never_blocks_the_server_even_with_a_batch_bigger_than_the_pipe(tmp_path):
    """A batch is written to rank 0's pipe by a sender thread: with rank 0 stopped (SIGSTOP) and a
    300 KB prompt (a pipe holds 64 KiB), /ping still answers at once and the request times out as set."""
    import os
    import signal
    import threading

    record = tmp_path / "record"
    record.mkdir()
    prompt = "x" * 300_000
    room = {"max_sequence_length": prompt_tokens(prompt) + 2}  # the prompt fits: it reaches rank 0
    with serve_fake(tmp_path / "m", room, engine_kwargs={"record_dir": str(record)}, request_timeout_s=2.0,
                    max_body_bytes=1 << 20) as srv:
        [pid] = _rank_pids(record, 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            reply = {}
            thread = threading.Thread(target=lambda: reply.update(r=httpx.post(
                srv.url + "/invocations", json={"inputs": prompt, "parameters": {"max_new_tokens": 2}},
                timeout=30)))
            start = time.monotonic()
            thread.start()
            time.sleep(0.5)  # the batch is on its way to rank 0
            for _ in range(5):
                asked = time.monotonic()
                assert httpx.get(srv.url + "/ping", timeout=5).status_code == 200
                assert time.monotonic() - asked < 1.0
                time.sleep(0.1)
            thread.join(20)
            assert reply["r"].status_code == 424 and "timed out after 2s" in reply["r"].json()["error"]
            assert time.monotonic() - start < 6
        finally:
            os.kill(pid, signal.SIGKILL)


def test_a_drain_that_times_out_answers_503_to_what_is_left(tmp_path, caplog):
    """SIGTERM drains for at most the drain timeout; then the requests still generating or queued are
    answered 503 (a stream: its error line) before the server stops, and no handler dies cancelled."""
    import signal

    plan = fake_plan(batch_size=1, max_batch_delay_ms=0)
    runtime = Runtime(write_artifact(tmp_path / "m", plan, {"step_delay_s": 0.5}), plan, request_timeout_s=60)
    replies = {}
    with ServerThread(runtime, drain_timeout_s=1.0) as server:
        server.wait_ready()

        def ask(name, stream):
            reply = post(server, {"inputs": name, "parameters": {"max_new_tokens": 40}, "stream": stream})
            replies[name] = (reply.status_code, json.loads(reply.text.splitlines()[-1]))

        threads = [threading.Thread(target=ask, args=(name, name == "streamed")) for name in ("generating", "streamed")]
        for thread in threads:  # batch size 1: one generates, the other waits in the queue
            thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and runtime._in_flight < 2:
            time.sleep(0.02)
        server.server.handle_exit(signal.SIGTERM, None)
        for thread in threads:
            thread.join(20)
        server.thread.join(20)
        assert not server.thread.is_alive()
    error = {"error": "the server stopped (drain timed out after 1s) before this request finished", "code": 503}
    assert replies == {"generating": (503, error), "streamed": (200, error)}
    assert "Exception in ASGI application" not in caplog.text and "CancelledError" not in caplog.text


def test_a_group_that_dies_while_the_server_drains_comes_back_for_the_queued_requests(tmp_path):
    """Draining does not stop restarts (workers ignore SIGTERM: a death then is a crash like any
    other): the request the dead group held fails, the queued ones are served by its restart."""
    import os
    import signal
    import threading

    record = tmp_path / "record"
    record.mkdir()
    with serve_fake(tmp_path / "m", {"batch_size": 1, "max_batch_delay_ms": 0},
                    {"step_delay_s": 0.05, "record_dir": str(record)}, request_timeout_s=30.0) as srv:
        replies = {}

        def ask(i):
            replies[i] = httpx.post(srv.url + "/invocations", timeout=60,
                                    json={"inputs": f"queued {i}", "parameters": {"max_new_tokens": 20}})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
            time.sleep(0.1)  # in order: the first one generates, the others wait in the queue
        wait_in_flight(srv.url, 3, timeout_s=10)
        srv.runtime.begin_drain()
        [pid] = _rank_pids(record, 0)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        assert time.monotonic() - killed < 15  # not the 30 s request timeout
        assert replies[0].status_code == 424 and "died" in replies[0].json()["error"]
        assert {i: replies[i].json() for i in (1, 2)} == {
            i: {"generated_text": expected_text(f"queued {i}", 20)} for i in (1, 2)}
        assert len(_rank_pids(record, 0)) == 2  # the restart served them


def test_the_default_body_limit_is_sagemakers_6_mb_and_every_client_reads_its_413(tmp_path):
    """An 8 MiB body gets a 413 that urllib, requests and curl each actually read (the server keeps reading
    and discarding the body instead of closing under a client still sending: a reset, before); 5 MB passes."""
    import subprocess
    import urllib.error
    import urllib.request

    import requests

    from lmc.runtime.core import DEFAULT_MAX_BODY_BYTES

    assert DEFAULT_MAX_BODY_BYTES == 6_000_000
    big = b'{"inputs": "hi"}' + b" " * (8 * 1024 * 1024)  # valid JSON, 8 MiB: only its size is wrong
    with serve_fake(tmp_path / "m") as srv:
        url = srv.url + "/invocations"
        statuses = {}
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=big, headers={"content-type": "application/json"}),
                                   timeout=60)
        except urllib.error.HTTPError as exc:
            statuses["urllib"] = (exc.code, json.loads(exc.read())["code"])
        reply = requests.post(url, data=big, timeout=60)
        statuses["requests"] = (reply.status_code, reply.json()["code"])
        body_file = tmp_path / "big.json"
        body_file.write_bytes(big)
        curl = subprocess.run(["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "--data-binary", f"@{body_file}",
                               "-H", "content-type: application/json", url], capture_output=True, timeout=60)
        answer, code = curl.stdout.rsplit(b"\n", 1)
        statuses["curl"] = (int(code), json.loads(answer)["code"])
        assert statuses == {"urllib": (413, 413), "requests": (413, 413), "curl": (413, 413)}, (statuses, curl.stderr)
        # Chunked (no length): the same answer once the limit is passed.
        reply = requests.post(url, data=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]), timeout=60)
        assert reply.status_code == 413 and "exceeds the limit of 6000000 bytes" in reply.json()["error"]
        five_mb = b'{"inputs": "hi", "parameters": {"max_new_tokens": 3}}' + b" " * 5_000_000
        reply = requests.post(url, data=five_mb, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["generated_text"] == expected_text("hi", 3)
