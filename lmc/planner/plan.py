"""The Plan: fully resolved and frozen. Its JSON is the contract of `lmc plan --json`."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lmc.manifest import digest_json  # the artifact's digests too, and `lmc build --plan`'s check of a reviewed file


# Plan sections present only where they apply: kv_cache for continuous plans, vllm for vLLM plans, lora and
# speculative where the spec serves adapters or speculates (lmc.planner.lora, .speculative).
OPTIONAL_SECTIONS = ("kv_cache", "vllm", "lora", "speculative")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanExperts(_Frozen):
    """A mixture-of-experts model's experts."""

    routed: int = Field(ge=2, description="Routed experts per MoE block.")
    active: int = Field(ge=1, description="Routed experts each token goes through.")
    shared: int = Field(ge=0, description="Experts every token goes through besides.")
    moe_layers: int = Field(ge=0, description="Blocks with experts (the others are dense).")


class PlanModel(_Frozen):
    id: str
    revision: str | None = Field(default=None, description="The commit the facts were read at (Hub ids).")
    family: str
    architecture: str = ""
    parameters: int
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    vocab_size: int
    attention: Literal["mha", "gqa", "mqa", "mla"] = "mha"
    kv_bytes_per_token: int = Field(default=0, ge=0, description="KV cache bytes per token over all layers, one TP rank, at the planned dtype (full-attention layers; sliding ones hold at most their window).")
    active_parameters: int = Field(default=0, ge=0, description="Parameters one token multiplies through (routed experts at k/E).")
    experts: PlanExperts | None = None
    sliding_window: int | None = Field(default=None, description="Window of the sliding-window layers, if any.")
    sliding_window_layers: int = Field(default=0, ge=0)
    vision_parameters: int = Field(default=0, ge=0, description="Parameters outside the language model (multimodal wrappers).")
    checkpoint_quantization: str | None = Field(default=None, description="The checkpoint's own quantization (quant_method → weights), None for 16/32-bit.")


class PlanTarget(_Frozen):
    instance: str
    accelerator: str
    devices: int
    device_memory_bytes: int
    instances: int
    price_per_hour: float | None


class MemoryPerDevice(_Frozen):
    weights: int
    kv_cache: int
    activations: int
    runtime_overhead: int
    total: int
    capacity: int
    headroom: int


class Predicted(_Frozen):
    ttft_ms: float
    tpot_ms: float
    throughput_tokens_per_s: float
    load_seconds: float
    cost_per_hour: float | None
    cost_per_million_tokens: float | None
    step_times: str | None = Field(default=None, description="The model that produced the step times behind these figures: aiconfigurator-core's measured data (GPU, engine version) or lmc's roofline, and why (planner/steps.py).")


class KvCache(_Frozen):
    """The paged KV cache of a continuous-batching plan (per replica)."""

    block_size: int = Field(ge=1, description="Tokens per KV block.")
    blocks: int = Field(ge=0, description="KV blocks in the pool of one replica.")
    max_concurrent_sequences: int = Field(ge=0, description="Sequences of the workload's full length the pool holds at once.")


class VllmConfig(_Frozen):
    """vLLM engine arguments the plan sets (vLLM plans only)."""

    max_num_seqs: int = Field(ge=0, description="Sequences scheduled at once (vLLM --max-num-seqs).")
    max_model_len: int = Field(ge=0, description="Longest sequence, prompt + output (vLLM --max-model-len).")
    max_num_batched_tokens: int = Field(ge=0, description="Tokens per scheduler step; longer prefills are chunked.")
    gpu_memory_utilization: float = Field(ge=0, le=1, description="Share of device memory vLLM may use.")
    cpu_kvcache_space_gib: int | None = Field(default=None, ge=1, description="CPU plans: VLLM_CPU_KVCACHE_SPACE, the KV pool per rank in whole GiB (None on GPUs).")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(default="auto", description="vLLM --kv-cache-dtype: auto (the compute dtype) or fp8 (e4m3, half the bytes per token: twice the sequences in the pool), planned where the GPU has fp8 and the pool limits the concurrency.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(default="bfloat16", description="vLLM --dtype: the compute dtype (activations, KV cache, unquantized weights).")
    quantization: Literal["fp8"] | None = Field(default=None, description="vLLM --quantization: fp8 is its online quantization of 16-bit weights; None for unquantized weights and for a quantized checkpoint (vLLM reads its quantization_config).")
    enable_expert_parallel: bool = Field(default=False, description="vLLM --enable-expert-parallel: whole experts on each rank instead of every expert split across them (MoE models: pin.expert_parallel, or data-parallel attention).")
    data_parallel_size: int = Field(default=1, ge=1, description="vLLM --data-parallel-size: groups of tensor_parallel_degree ranks, each with its own attention, KV pool and max_num_seqs sequences, the experts spread over all (MoE models; 1 = none).")
    max_num_queued_reqs: int | None = Field(default=None, ge=1, description="vLLM --max-num-queued-reqs: requests running or waiting at once; one more is answered 503 (from the TTFT goal: the waiting a new request may meet and still see its first token within it).")
    retry_after_s: int | None = Field(default=None, ge=1, description="The Retry-After lmc adds to that 503: about the time for one running request to end, the batch full.")
    tool_call_parser: str | None = Field(default=None, description="vLLM --tool-call-parser with --enable-auto-tool-choice (serving.tool_call_parser).")
    reasoning_parser: str | None = Field(default=None, description="vLLM --reasoning-parser (serving.reasoning_parser).")


class LoraAdapter(_Frozen):
    """One adapter the plan serves, as read."""

    name: str
    source: str = Field(description="The spec's path, or Hub id@commit.")
    revision: str | None = Field(default=None, description="The Hub commit read (Hub adapters).")
    rank: int = Field(ge=1)
    target_modules: list[str]
    weight_bytes: int = Field(ge=0, description="Its safetensors tensors' bytes, else rank × the adapted modules' widths at 16 bits.")


class LoraSection(_Frozen):
    """vLLM's LoRA settings (plans with [[adapters]]; lmc.planner.lora)."""

    max_loras: int = Field(ge=1, description="vLLM --max-loras: adapters in one batch (every adapter, at most max_num_seqs).")
    max_lora_rank: int = Field(ge=1, description="vLLM --max-lora-rank: the smallest vLLM allows at or above every adapter's rank.")
    max_cpu_loras: int = Field(ge=1, description="vLLM --max-cpu-loras: adapters held in host memory (all of them).")
    slot_bytes_per_device: int = Field(ge=0, description="The slots' bytes per device, inside memory_per_device.weights (out of the KV pool).")
    adapters: list[LoraAdapter]


class SpeculativeSection(_Frozen):
    """Speculative decoding as planned (plans with [speculative]; lmc.planner.speculative)."""

    method: Literal["ngram", "draft", "eagle3", "mtp"]
    vllm_method: str = Field(description="vLLM's speculative_config method.")
    num_tokens: int = Field(ge=1, description="Tokens proposed per step (num_speculative_tokens).")
    model: str | None = Field(default=None, description="The draft model or EAGLE-3 head, as the spec names it.")
    enabled: bool = Field(description="Whether the plan runs it: off where it does not shorten a step at the planned batch.")
    acceptance_rate: float = Field(gt=0, lt=1)
    acceptance_source: str = Field(description="The spec, or the published figure it comes from.")
    tokens_per_step: float = Field(description="(1 − α^(k+1)) / (1 − α): tokens a target step yields.")
    draft_bytes_per_device: int = Field(ge=0, description="The proposer's weights per device, inside memory_per_device.weights.")
    revision: str | None = Field(default=None, description="The Hub commit of the draft or head read.")
    batch: int = Field(ge=1, description="The planned batch per replica the figures are at.")
    tpot_ms_without: float
    tpot_ms_with: float
    stops_paying_at_batch: int | None = Field(default=None, description="The smallest batch at which it no longer shortens a step (None: not up to 512).")


class Deployment(_Frozen):
    """How the plan spreads over instances."""

    instances: int = Field(ge=1, description="Instances the plan runs on.")
    pipeline_parallel_degree: int = Field(default=1, ge=1, description="Pipeline stages (instances per model copy).")
    min_instances: int = Field(ge=1, description="Autoscaling lower bound.")
    max_instances: int = Field(ge=1, description="Autoscaling upper bound.")
    requests_per_second: float = Field(default=0.0, ge=0, description="Requests per second the planned instances carry: predicted throughput / max_output_tokens (docs/goals-and-admission.md).")
    cost_per_million_tokens_at_rate: float | None = Field(default=None, ge=0, description="USD per million output tokens at the spec's requests_per_second (None without a rate or a price).")


class Decision(_Frozen):
    key: str
    value: str | int | float | bool | None
    reason: str


class Alternative(_Frozen):
    engine: str
    dtype: str
    tensor_parallel_degree: int
    data_parallel_degree: int = Field(default=1, ge=1, description="vLLM data-parallel groups of tensor_parallel_degree ranks per replica (1: none).")
    replicas: int
    verdict: Literal["rejected", "feasible"]
    reason: str


class Plan(_Frozen):
    lmc_version: str
    spec_sha256: str
    plan_sha256: str = ""
    model: PlanModel
    target: PlanTarget
    engine: Literal["deepspeed", "hf", "neuronx", "vllm"]
    dtype: Literal["fp32", "fp16", "bf16", "int8", "fp8", "int4", "mxfp4"]
    quantization: str | None
    tensor_parallel_degree: int = Field(ge=1)
    replicas: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    max_batch_delay_ms: int = Field(ge=0)
    job_queue_size: int = Field(ge=1, description="Requests one server holds waiting beyond those running before it answers 503: from the TTFT goal (docs/goals-and-admission.md); serving.properties writes the same.")
    max_sequence_length: int = Field(ge=1)
    scheduling: Literal["dynamic", "continuous"] = "dynamic"
    kv_cache: KvCache | None = None
    vllm: VllmConfig | None = None
    lora: LoraSection | None = None
    speculative: SpeculativeSection | None = None
    deployment: Deployment
    memory_per_device: MemoryPerDevice
    predicted: Predicted
    goal_met: bool = Field(description="The workload's concurrency is admitted and meets the TPOT and TTFT goals with its queueing; false: `lmc plan` exits 4, build and deploy refuse it without --accept-missed-goal.")
    decisions: list[Decision]
    alternatives: list[Alternative]

    def to_dict(self) -> dict:
        """The plan as JSON data; `kv_cache` and `vllm` only where they apply (docs/plan.md)."""
        body = self.model_dump(mode="json")
        for key in OPTIONAL_SECTIONS:
            if body.get(key) is None:
                body.pop(key, None)
        return body

    def with_digest(self) -> "Plan":
        """The same plan with plan_sha256 set: the digest of its JSON without that field."""
        return self.model_copy(update={"plan_sha256": digest_json({**self.to_dict(), "plan_sha256": ""})})

    def to_json(self) -> str:
        """Stable, readable JSON (key order as in docs/plan.md, 2-space indent, trailing newline)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def decision(self, key: str) -> Decision | None:
        return next((d for d in self.decisions if d.key == key), None)
