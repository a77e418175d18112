"""The human view of a plan: configuration, memory bars, predictions against the goal, alternatives.

Plain text, ≤ 100 columns, deterministic (the lead snapshot-tests it).
"""

from __future__ import annotations

import textwrap

from lmc.planner.plan import Plan
from lmc.planner.sizing import instances_per_copy_of

WIDTH = 100
BAR = 34
GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:6.1f} GiB"


def _bar(value: int, capacity: int) -> str:
    """A bar of BAR cells, filled in proportion to value/capacity (clipped; overflow marked '!')."""
    if capacity <= 0:
        return "?" * BAR
    filled = round(BAR * max(value, 0) / capacity)
    if filled > BAR:
        return "█" * (BAR - 1) + "!"
    return "█" * filled + "░" * (BAR - filled)


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, width=WIDTH, initial_indent=indent, subsequent_indent=indent + "  ") or [indent]


def _mark(predicted: float, goal: float | None) -> str:
    if goal is None:
        return "  (no goal)"
    return f"  {'✓' if predicted <= goal else '✗'} goal {goal:g} ms"


def _served_lines(plan: Plan) -> list[str]:
    """The LoRA slots and speculative decoding, when the plan serves them (`--explain` has the reasons)."""
    lines: list[str] = []
    if plan.lora is not None:
        lora = plan.lora
        lines += _wrap(f"lora {len(lora.adapters)} adapter(s) · max_loras {lora.max_loras} · max_lora_rank "
                       f"{lora.max_lora_rank} · max_cpu_loras {lora.max_cpu_loras} · slots "
                       f"{lora.slot_bytes_per_device / GIB:.2f} GiB per device (in weights)", "  ")
    if plan.speculative is not None:
        spec = plan.speculative
        state = (f"on: {spec.tpot_ms_with:g} ms a decode step's token, {spec.tpot_ms_without:g} without" if spec.enabled
                 else f"off: it does not pay at batch {spec.batch}")
        lines += _wrap(f"speculative {spec.method} · {spec.num_tokens} token(s) a step · acceptance "
                       f"{spec.acceptance_rate:g} · {state}", "  ")
    return lines


def render_plan(plan: Plan, spec, explain: bool = False) -> str:
    t, m, p = plan.target, plan.memory_per_device, plan.predicted
    lines = [f"lmc plan: {plan.model.id} on {t.instance}"]
    lines.append(f"  model   {plan.model.family}, {plan.model.parameters / 1e9:.2f}B parameters, "
                 f"{plan.model.layers} layers, {plan.model.attention_heads} heads / {plan.model.kv_heads} kv heads")
    price = f", ${t.price_per_hour:g}/h each" if t.price_per_hour is not None else ""
    lines.append(f"  target  {t.instances} × {t.instance}: {t.devices} × {t.accelerator} "
                 f"({t.device_memory_bytes / GIB:.1f} GiB){price}")
    lines.append("")
    lines.append("configuration")
    quant = f" ({plan.quantization})" if plan.quantization else ""
    stages = plan.deployment.pipeline_parallel_degree
    pipeline = f"PP {stages} · " if stages > 1 else ""
    if plan.vllm is not None and plan.vllm.data_parallel_size > 1:
        groups = "attention; experts parallel over all ranks" if plan.vllm.enable_expert_parallel else "engines"
        copy = instances_per_copy_of(plan)
        across = f", {copy} instances per copy" if copy > 1 and stages == 1 else ""
        pipeline = f"DP {plan.vllm.data_parallel_size} ({groups}{across}) · " + pipeline
    lines.append(f"  engine {plan.engine} · dtype {plan.dtype}{quant} · TP {plan.tensor_parallel_degree} · "
                 f"{pipeline}replicas {plan.replicas} · batch {plan.batch_size}")
    d = plan.deployment
    lines.append(f"  instances {d.instances} (autoscaling {d.min_instances}–{d.max_instances}) · "
                 f"{d.requests_per_second:g} requests/s")
    lines.append(f"  max_batch_delay {plan.max_batch_delay_ms} ms · job_queue_size {plan.job_queue_size} · "
                 f"max_sequence_length {plan.max_sequence_length}")
    if plan.kv_cache is not None:
        kv = plan.kv_cache
        sliding = (f" ({plan.model.sliding_window_layers} layers slide over {plan.model.sliding_window})"
                   if plan.model.sliding_window_layers and plan.model.sliding_window else "")
        lines.append(f"  {plan.scheduling} batching · KV {kv.blocks} blocks × {kv.block_size} tokens = "
                     f"{kv.blocks * kv.block_size} tokens, {kv.max_concurrent_sequences} full-length "
                     f"sequences{sliding}")
    if plan.vllm is not None:
        v = plan.vllm
        space = f" · VLLM_CPU_KVCACHE_SPACE {v.cpu_kvcache_space_gib}" if v.cpu_kvcache_space_gib else ""
        lines.append(f"  vllm max_num_seqs {v.max_num_seqs} · max_model_len {v.max_model_len} · "
                     f"max_num_batched_tokens {v.max_num_batched_tokens}")
        lines.append(f"       gpu_memory_utilization {v.gpu_memory_utilization:g}{space}")
    lines += _served_lines(plan)
    lines.append("")
    lines.append("memory per device")
    for name, value in (("weights", m.weights), ("kv cache", m.kv_cache), ("activations", m.activations),
                        ("runtime", m.runtime_overhead)):
        lines.append(f"  {name:<11} {_bar(value, m.capacity)} {_gib(value)}")
    lines.append(f"  {'total':<11} {_bar(m.total, m.capacity)} {_gib(m.total)} of {_gib(m.capacity).strip()} "
                 f"capacity, {_gib(m.headroom).strip()} free")
    lines.append("")
    lines.append("predicted")
    goal = spec.goal
    lines.append(f"  TPOT        {p.tpot_ms:10.2f} ms{_mark(p.tpot_ms, goal.tpot_ms)}")
    lines.append(f"  TTFT        {p.ttft_ms:10.2f} ms{_mark(p.ttft_ms, goal.ttft_ms)}")
    lines.append(f"  throughput  {p.throughput_tokens_per_s:10.1f} tokens/s")
    lines.append(f"  load        {p.load_seconds:10.1f} s")
    if p.step_times:
        lines.append(f"  step times  {p.step_times}")
    if p.cost_per_hour is not None and p.cost_per_million_tokens is not None:
        cap = spec.budget.max_cost_per_hour
        mark = f"  {'✓' if p.cost_per_hour <= cap else '✗'} max ${cap:g}/h" if cap is not None else ""
        lines.append(f"  cost        {p.cost_per_hour:10.2f} $/h{mark}")
        lines.append(f"              {p.cost_per_million_tokens:10.4f} $ per million tokens")
        if plan.deployment.cost_per_million_tokens_at_rate is not None:
            lines.append(f"              {plan.deployment.cost_per_million_tokens_at_rate:10.4f} $ per million tokens "
                         "at the workload's rate")
    lines.append(f"  goal met    {'yes' if plan.goal_met else 'NO'}")
    if not plan.goal_met:
        gap = plan.decision("goal")
        if gap is not None:
            lines += _wrap(gap.reason, "    ")
    shown = plan.alternatives if explain else plan.alternatives[:3]
    if shown:
        lines.append("")
        lines.append("alternatives" if explain else "best alternatives (--explain for all, with reasons)")
        for a in shown:
            dp = f" DP {a.data_parallel_degree}" if a.data_parallel_degree > 1 else ""
            head = f"  {a.verdict:<8} {a.engine} {a.dtype} TP {a.tensor_parallel_degree}{dp} × {a.replicas}"
            lines += _wrap(f"{head}: {a.reason}", "") if explain else [head[:WIDTH]]
    if explain:
        lines.append("")
        lines.append("decisions")
        for d in plan.decisions:
            lines += _wrap(f"{d.key} = {d.value}: {d.reason}", "  ")
    return "\n".join(line.rstrip() for line in lines) + "\n"
