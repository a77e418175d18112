"""`lmc bench` on a tiny model: the real runtime served for the run, the report as JSON, table and PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmc.measure.bench import default_levels
from lmc.measure.report import percentile
from lmc.measure.profile import render_profile
from tests.test_measure_profile import _calibration

SPEC = """\
[model]
id = "lmc/tiny-llama"
path = "ckpt"
[target]
instance = "local"
profile = "local.toml"
[workload]
max_input_tokens = 12
max_output_tokens = 6
concurrency = 3
[pin]
engine = "hf"
dtype = "fp32"
tensor_parallel_degree = 1
"""


def _lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_bench_reports_each_level_of_a_served_artifact(tmp_path):
    from lmc.testing.checkpoints import make_checkpoint

    make_checkpoint("llama", tmp_path / "ckpt")
    (tmp_path / "local.toml").write_text(render_profile(_calibration()))
    (tmp_path / "spec.toml").write_text(SPEC)
    assert _lmc("build", str(tmp_path / "spec.toml"), "--format", "dir", "-o", str(tmp_path / "model")).returncode == 0
    out = _lmc("bench", str(tmp_path / "model"), "--spec", str(tmp_path / "spec.toml"), "--requests", "3",
               "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    plan = json.loads((tmp_path / "model" / "lmc.json").read_text())["plan"]
    assert report["kind"] == "lmc-bench" and report["plan_sha256"] == plan["plan_sha256"]
    # The spec's workload; the prompt word's token biased so that every token streams on its own.
    assert (report["workload"]["input_tokens"], report["workload"]["output_tokens"]) == (12, 6)
    assert isinstance(report["workload"]["logit_bias_token"], int)
    assert [level["concurrency"] for level in report["levels"]] == [1, 2, 3]
    weights = (tmp_path / "model" / "shards" / "tp1" / "rank0.safetensors").stat().st_size
    for level in report["levels"]:
        # Every answer came back with exactly 6 tokens (else it counts as an error), none failed.
        assert level["requests"] == 3 and level["errors"] == 0, level["first_error"]
        assert level["chunks_per_token"] == 1.0
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            stats = level[key]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
        assert level["ttft_ms"]["p50"] < level["e2e_ms"]["p50"]
        assert level["output_tokens_per_s"] == pytest.approx(3 * 6 / level["wall_s"], rel=0.01)
        # A worker holds torch and the model: far more than the weights, far less than the machine.
        assert weights < level["peak_worker_memory_bytes"] < 4 * 2**30
    assert report["peak_worker_memory_bytes"] >= max(level["peak_worker_memory_bytes"] for level in report["levels"])
    assert report["workers"]
    table = out.stdout.splitlines()
    assert table[0].startswith("lmc bench ") and "12 prompt tokens, 6 output tokens" in table[0]
    assert [row.split()[:3] for row in table[2:5]] == [["1", "3", "0"], ["2", "3", "0"], ["3", "3", "0"]]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The comparison reads the report back.
    compared = _lmc("plan", str(tmp_path / "spec.toml"), "--compare", str(tmp_path / "bench.json"), "--json")
    assert compared.returncode == 0 and json.loads(compared.stdout)["same_plan"]


@pytest.mark.parametrize(("args", "message"), [
    (["/nonexistent/model.tar.gz"], "no such artifact"),
    (["http://127.0.0.1:9"], "give --input-tokens and --output-tokens, or --spec"),
    (["http://127.0.0.1:9", "--input-tokens", "8", "--output-tokens", "4", "--concurrency", "0"], "each level must be 1 to 1024"),
    (["http://127.0.0.1:9", "--input-tokens", "8", "--output-tokens", "1"], "at least 2"),
    # Found by fuzzing the flags: 0 read as "not given" (a misleading message, or a run of the default size),
    # a prompt of 1e11 words (MemoryError, exit 70), timeouts of 0 or NaN, an empty level, and an output file
    # in no directory (the figures lost after the whole run).
    (["http://127.0.0.1:9", "--input-tokens", "0", "--output-tokens", "4"], "--input-tokens 0: must be at least 1"),
    (["http://127.0.0.1:9", "--input-tokens", "8", "--output-tokens", "4", "--requests", "0"],
     "--requests 0: must be at least 1"),
    (["http://127.0.0.1:9", "--input-tokens", "99999999999", "--output-tokens", "4"], "at most 10,000,000"),
    (["http://127.0.0.1:9", "--input-tokens", "8", "--output-tokens", "4", "--timeout", "nan"],
     "--timeout nan: must be a positive number of seconds"),
    (["http://127.0.0.1:9", "--input-tokens", "8", "--output-tokens", "4", "--concurrency", "1,,2"],
     "expected comma-separated whole numbers"),
    (["http://127.0.0.1:9", "--input-tokens", "8", "--output-tokens", "4", "--json", "/nonexistent/dir/b.json"],
     "--json /nonexistent/dir/b.json: no such directory /nonexistent/dir"),
])
def test_bench_usage_errors_are_one_line_exit_2(args, message):
    out = _lmc("bench", *args)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1


def test_a_server_that_cannot_be_reached_is_one_line_exit_1():
    """It was a ConnectError traceback's last line as an internal error (exit 70)."""
    out = _lmc("bench", "http://127.0.0.1:9", "--input-tokens", "8", "--output-tokens", "4")
    assert out.returncode == 1
    assert out.stderr == ("lmc: error: http://127.0.0.1:9: cannot reach the server (ConnectError: All connection "
                          "attempts failed)\n")


def test_percentiles_match_numpys_linear_method():
    import numpy

    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(numpy.percentile(values, q))


def test_default_levels_double_up_to_the_workload_concurrency():
    assert default_levels(1) == [1]
    assert default_levels(8) == [1, 2, 4, 8]
    assert default_levels(12) == [1, 2, 4, 8, 12]


@pytest.mark.slow
def test_bench_fails_in_one_line_when_requests_fail(tmp_path):
    """A server whose every timed request fails (the runtime's request timeout, 1 s, is shorter than the
    fake engine's 4 tokens at 0.4 s each; sizing the prompt asks 1 token, which fits): lmc bench still
    writes the report, with the failures counted, and exits 1 saying so in one line."""
    from lmc.runtime.server import Runtime
    from runtime_fakes import ServerThread, fake_plan, write_artifact

    plan = fake_plan()
    model = write_artifact(tmp_path / "m", plan, {"step_delay_s": 0.4})
    with ServerThread(Runtime(model, plan, request_timeout_s=1.0)) as server:
        server.wait_ready()
        out = _lmc("bench", server.url, "--input-tokens", "6", "--output-tokens", "4", "--concurrency", "1",
                   "--requests", "2", "--json", str(tmp_path / "bench.json"))
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("lmc: error:")]
    assert errors == [f"lmc: error: {server.url}: 2 of 2 requests failed (first, at concurrency 1: "
                      f"{json.loads((tmp_path / 'bench.json').read_text())['levels'][0]['first_error']})"], out.stderr
    level = json.loads((tmp_path / "bench.json").read_text())["levels"][0]
    assert level["errors"] == 2 and level["tpot_ms"] is None and "timed out" in level["first_error"]


def test_a_report_with_failed_requests_or_a_missing_figure_is_a_failed_bench():
    from lmc.measure.loadgen import Sample
    from lmc.measure.report import bench_failure, bench_report, level_report

    def report(samples):
        level = level_report(1, samples, 1.0, None, output_tokens=4)
        return bench_report(lmc_version="0", target="t", plan=None, measured_at="now", host="h", input_tokens=8,
                            output_tokens=4, levels=[level], memory_source=None, workers={})

    good = Sample(0.0, 0.1, 0.4, 8, 4, None, 4)
    assert bench_failure(report([good, good])) is None
    short = Sample(0.0, 0.1, 0.4, 8, 3, None, 3)
    failed = Sample(0.0, 0.0, 0.4, 0, 0, "HTTP 500: boom", 0)
    assert bench_failure(report([good, short])) == "1 of 2 requests failed (first, at concurrency 1: 3 tokens instead of 4)"
    assert bench_failure(report([failed, failed])) == "2 of 2 requests failed (first, at concurrency 1: HTTP 500: boom)"
    missing = report([good])
    missing["levels"][0]["tpot_ms"] = None
    assert bench_failure(missing) == "concurrency 1: no tpot_ms measured"
