"""The facts the planner reasons over: frozen, validated, built from data files or checkpoints.

The planner takes facts, not names: tests build these in memory.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The families lmc has a tensor-parallel layout for (lmc/layouts.py); any other architecture is known
# by its config's model_type (qwen3, gemma3_text, deepseek_v3, ...) and planned from its config alone.
LAYOUT_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "gptj", "gpt_neox", "opt", "bloom", "t5")
Family = Literal["llama", "mistral", "mixtral", "qwen2", "gptj", "gpt_neox", "opt", "bloom", "t5"]
ModelType = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", max_length=64)]
DeviceKind = Literal["gpu", "neuron", "cpu"]
DtypeName = Literal["fp32", "fp16", "bf16", "int8", "fp8"]
# Quantizations a checkpoint arrives in (config.json `quantization_config`), as lmc names their weights.
CheckpointQuantization = Literal["fp8", "int8", "int4", "mxfp4"]

# One table of dtype sizes, in bytes per element. int4 and mxfp4 are checkpoint formats (AWQ/GPTQ
# 4-bit, OCP MX fp4): 4 bits per weight; their scales are counted beside them (architecture.py).
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1, "int4": 0.5, "mxfp4": 0.5}
# Devices in one target, as the spec's `target.devices` allows: the largest catalog host has 32
# (trn1.32xlarge NeuronCores); far more is a typo, and a plan would start a worker process for each.
MAX_DEVICES = 1024


# The slowest rates a profile may state: below them no device, storage or link moves data or computes, and
# the times they divide overflow (a denormal bandwidth planned an infinite TPOT and crashed the search).
MIN_BYTES_PER_S = 1.0e6  # 1 MB/s
MIN_TFLOPS = 1.0e-6  # 1 MFLOPS


class _Facts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelFacts(_Facts):
    """A model's architecture, as the memory and latency math needs it."""

    id: str = Field(description="The model id (HF hub style).")
    family: ModelType = Field(description="lmc's layout family (llama, gptj, ...) where it has one, else the config's model_type (qwen3, gemma3_text, ...).")
    architecture: str = Field(description="The HF class name from config.json `architectures` (the wrapper's, for multimodal models).")
    revision: str | None = Field(default=None, description="The commit the facts were read at (Hub ids), else None.")
    is_encoder_decoder: bool = Field(default=False, description="T5-style encoder-decoder.")
    parameters: int = Field(gt=0, description="Total parameter count (exact from safetensors headers, or the catalog's).")
    layers: int = Field(gt=0, description="Transformer blocks (the decoder's, for encoder-decoder models).")
    encoder_layers: int = Field(default=0, ge=0, description="Encoder blocks of an encoder-decoder model.")
    hidden_size: int = Field(gt=0, description="Model width (d_model).")
    attention_heads: int = Field(gt=0, description="Query heads.")
    kv_heads: int = Field(gt=0, description="Key/value heads (fewer than attention_heads under GQA/MQA).")
    head_dim: int = Field(gt=0, description="Width of one attention head.")
    intermediate_size: int = Field(gt=0, description="MLP inner width (per expert for MoE).")
    vocab_size: int = Field(gt=0, description="Vocabulary size (rows of the embedding).")
    max_position_embeddings: int | None = Field(default=None, gt=0, description="Longest sequence the model supports; None where unbounded (ALiBi, relative).")
    tie_word_embeddings: bool = Field(default=False, description="LM head shares the input embedding.")
    num_experts: int = Field(default=1, ge=1, description="MoE routed experts per layer (1 for dense).")
    experts_per_token: int = Field(default=1, ge=1, description="Experts each token is routed to.")
    shared_experts: int = Field(default=0, ge=0, description="Experts every token passes through besides the routed ones (DeepSeek, Llama 4).")
    shared_expert_width: int = Field(default=0, ge=0, description="MLP width of the shared experts together (n_shared_experts × the expert width, Qwen2-MoE's shared_expert_intermediate_size, Llama 4's one as wide as a routed one); 0 = none.")
    moe_layers: int | None = Field(default=None, ge=0, description="Blocks with experts (the rest are dense, as DeepSeek's first three); None = every block of an MoE model.")
    dense_intermediate_size: int = Field(default=0, ge=0, description="MLP width of an MoE model's dense blocks (DeepSeek's and GLM-4's first ones); 0 = every block has experts, or not known.")
    expert_parameters: int = Field(default=0, ge=0, description="Parameters of all routed experts together (0 for dense): what a token reads only k/E of.")
    active_parameters: int = Field(default=0, ge=0, description="Parameters one token multiplies through (routed experts at k/E); 0 = all of them.")
    kv_lora_rank: int = Field(default=0, ge=0, description="MLA (DeepSeek-V2/V3, Kimi K2): width of the compressed KV latent; 0 for other attention.")
    qk_rope_head_dim: int = Field(default=0, ge=0, description="MLA: the rotary key part cached beside the latent.")
    sliding_window: int | None = Field(default=None, gt=0, description="Tokens a sliding-window layer attends to; None where no layer slides.")
    sliding_window_layers: int = Field(default=0, ge=0, description="Blocks with sliding-window attention (Gemma 2/3, gpt-oss mix them with full ones).")
    qk_norm_allreduce: bool = Field(default=False, description="A block's q/k RMSNorm spans all heads, so at TP > 1 vLLM all-reduces each token's q and k variances over the ranks, one [tokens, 2] fp32 all-reduce a block (MiniMax-M2: layers/minimax_rms_norm/rms_norm_tp.py).")
    vision_parameters: int = Field(default=0, ge=0, description="Parameters outside the language model (vision tower, projector) of a multimodal wrapper; inside `parameters`.")
    checkpoint_quantization: CheckpointQuantization | None = Field(default=None, description="How the checkpoint's weights are quantized (quantization_config), None for 16/32-bit.")
    quantization_method: str | None = Field(default=None, description="quantization_config.quant_method as the checkpoint names it (fp8, awq, gptq, compressed-tensors, mxfp4, bitsandbytes).")
    quantization_block: int = Field(default=0, ge=0, description="Block-wise quantization's block along a weight's output rows (quantization_config.weight_block_size[0]: 128 for DeepSeek-V3's 128 × 128 fp8 blocks); 0 without blocks.")
    checkpoint_weight_bytes: int | None = Field(default=None, gt=0, description="Bytes of the checkpoint's weights (exact from safetensors metadata, else from the config); None = parameters × dtype.")
    torch_dtype: DtypeName = Field(default="fp16", description="The dtype the unquantized weights are stored in.")
    source: str = Field(description="Where these facts came from: a catalog file and its citation, or a checkpoint path.")
    mtp_layers: int = Field(default=0, ge=0, description="Multi-token-prediction layers the checkpoint carries beyond `layers` (DeepSeek-V3's num_nextn_predict_layers); what speculative method mtp runs.")
    # What is served beside the base weights (spec [[adapters]] and [speculative]): they change its memory and
    # its decode step, so the memory and latency math reads them with the model (lmc.planner.lora, .speculative).
    adapters: tuple["AdapterFacts", ...] = Field(default=(), description="LoRA adapters served beside the base (spec order).")
    speculative: "SpeculativeFacts | None" = Field(default=None, description="Speculative decoding as the spec asks for it.")

    @property
    def attention(self) -> str:
        """mla, mha (kv heads = heads), mqa (one kv head) or gqa."""
        if self.kv_lora_rank:
            return "mla"
        if self.kv_heads == self.attention_heads:
            return "mha"
        return "mqa" if self.kv_heads == 1 else "gqa"

    @property
    def routed_experts(self) -> int:
        """Parameters of the routed experts: `expert_parameters`, else (facts that do not give it) every
        block's experts as gated MLPs of `intermediate_size`; 0 for a dense model."""
        if self.num_experts <= 1:
            return 0
        return self.expert_parameters or self.layers * self.num_experts * 3 * self.hidden_size * self.intermediate_size

    @property
    def active(self) -> int:
        """Parameters one token multiplies through: the routed experts at experts_per_token of num_experts."""
        if self.active_parameters or self.num_experts <= 1:
            return self.active_parameters or self.parameters
        experts = self.routed_experts
        return self.parameters - experts + experts * self.experts_per_token // self.num_experts


class AdapterFacts(_Facts):
    """One LoRA adapter, read from its adapter_config.json (and its safetensors header where present)."""

    name: str = Field(description="The name clients select it by.")
    source: str = Field(description="Where it was read: a directory, or Hub id@commit.")
    revision: str | None = Field(default=None, description="The Hub commit read, for Hub adapters.")
    rank: int = Field(ge=1, description="LoRA rank r (adapter_config.json `r`).")
    alpha: float = Field(default=0, ge=0, description="lora_alpha, as given.")
    target_modules: tuple[str, ...] = Field(description="Module names the adapter adapts (adapter_config.json target_modules).")
    base_model: str | None = Field(default=None, description="base_model_name_or_path, as given.")
    weight_bytes: int = Field(ge=0, description="Bytes of its weights: the safetensors file's tensors, else rank × the adapted modules' widths at 16 bits.")


class SpeculativeFacts(_Facts):
    """Speculative decoding: the method, how many tokens it proposes, its expected acceptance and its draft."""

    method: Literal["ngram", "draft", "eagle3", "mtp"]
    num_tokens: int = Field(ge=1)
    acceptance_rate: float = Field(gt=0, lt=1, description="Expected share of proposed tokens accepted, per position.")
    acceptance_source: str = Field(description="Where the acceptance rate comes from (the spec, or a published figure).")
    draft: "ModelFacts | None" = Field(default=None, description="draft and eagle3: the proposer's own facts.")
    draft_source: str | None = Field(default=None, description="draft and eagle3: the spec's `model` as given.")


class InterconnectFacts(_Facts):
    """A link that ranks all-reduce over: the devices of one instance, or (as `network`) instances.

    One all-reduce of n bytes over p ranks costs (docs/planner.md, "All-reduce"):
    ring: allreduce_base_us + 2(p−1)·latency_us + 2(p−1)/p·n / bandwidth;
    tree: allreduce_base_us + 2·ceil(log2 p)·latency_us + 2·n / bandwidth.
    """

    name: str = Field(description="NVLink, PCIe gen4, NeuronLink-v2, shared memory, EFA, ...")
    bandwidth_bytes_per_s: float = Field(ge=MIN_BYTES_PER_S, description="Per-rank unidirectional bandwidth a collective moves data at (per device inside an instance; per instance for `network`).")
    latency_us: float = Field(ge=0, description="Latency of one step of a collective on this link, microseconds: a ring all-reduce takes 2(p−1) of them, a tree 2·ceil(log2 p).")
    allreduce_base_us: float = Field(default=0.0, ge=0, description="Fixed cost of one collective call whatever the rank count (the library's launch and synchronisation), microseconds.")
    algorithm: Literal["ring", "tree"] = Field(default="ring", description="The all-reduce algorithm the collective library uses on this link (NCCL: ring inside a node, tree across nodes).")


class MeasuredEngineFacts(_Facts):
    """What `lmc calibrate` measured one engine achieving on this hardware. Where present, these
    replace the engine's estimated efficiency figures (engines.toml) in the latency and memory model."""

    decode_bandwidth_bytes_per_s: dict[DtypeName, Annotated[float, Field(ge=MIN_BYTES_PER_S)]] = Field(
        description="Weight bytes per second a batch-1 decode step reads, per weight dtype (achieved, not peak).")
    prefill_tflops: dict[DtypeName, Annotated[float, Field(ge=MIN_TFLOPS)]] = Field(
        default_factory=dict, description="TFLOPS a prompt's prefill achieves through the engine, per compute dtype.")
    decode_tflops: dict[DtypeName, Annotated[float, Field(ge=MIN_TFLOPS)]] = Field(
        default_factory=dict, description="TFLOPS the decode step's skinny GEMMs add per extra batch row, per compute dtype.")
    step_overhead_ms: float = Field(ge=0, description="Fixed cost of one decode step (sampling, Python, the loop, serving).")
    prefill_overhead_ms: float = Field(default=0.0, ge=0, description="What a request pays before its prefill (HTTP, tokenizing, queueing, the pipe to the worker).")
    layer_overhead_ms: float = Field(ge=0, description="Fixed cost per transformer layer per step (operator dispatch).")
    runtime_overhead_bytes: int | None = Field(
        default=None, ge=0, description="Memory of a worker process with the engine loaded and no model (libraries, allocator).")
    source: str = Field(default="lmc calibrate", description="What was measured, how and when.")


class HardwareFacts(_Facts):
    """One target: an instance type (or the local CPU) and its accelerators."""

    name: str = Field(description="Instance name (ml.g5.12xlarge) or 'local'.")
    accelerator: str = Field(description="Accelerator name (a10g, a100-40gb, inferentia2, cpu).")
    kind: DeviceKind = Field(description="gpu, neuron or cpu.")
    devices: int = Field(gt=0, le=MAX_DEVICES, description="Devices per instance (NeuronCores for Neuron; 1 for CPU).")
    device_memory_bytes: int = Field(gt=0, description="Memory per device, bytes.")
    memory_bandwidth_bytes_per_s: float = Field(ge=MIN_BYTES_PER_S, description="Peak memory bandwidth per device.")
    tflops: dict[DtypeName, Annotated[float, Field(ge=MIN_TFLOPS)]] = Field(description="Dense peak TFLOPS per device, per dtype: one for each of `dtypes`.")
    dtypes: list[DtypeName] = Field(min_length=1, description="Dtypes the hardware computes in natively (no bf16 on T4/V100; fp8 on H100+).")
    interconnect: InterconnectFacts = Field(description="How the devices of one instance reach each other (what tensor-parallel all-reduces run over).")
    network: InterconnectFacts | None = Field(default=None, description="How this instance reaches other instances (EFA, or ENA where there is no EFA): per-instance bandwidth, one way; None where the catalog has no figure.")
    price_per_hour: float | None = Field(default=None, ge=0, description="On-demand USD/hour (us-east-1), None for local.")
    host_memory_bytes: int | None = Field(default=None, gt=0, description="Instance RAM.")
    instance_storage_bytes: int | None = Field(default=None, gt=0, description="Local NVMe instance storage (where SageMaker puts the model; such instances take no EBS volume); None: EBS only.")
    load_bandwidth_bytes_per_s: float = Field(default=1.0e9, ge=MIN_BYTES_PER_S, description="Storage-to-device read rate assumed for load time.")
    sagemaker_hosting: bool = Field(default=True, description="SageMaker offers the instance type for endpoints (CreateEndpointConfig's ProductionVariantInstanceType lists it); False for a training-only type, which `lmc deploy --target sagemaker` refuses.")
    source: str = Field(description="Datasheets and pages the figures come from.")
    measured: dict[Literal["deepspeed", "hf", "neuronx", "vllm"], MeasuredEngineFacts] = Field(
        default_factory=dict, description="Per engine name: figures `lmc calibrate` measured on this hardware.")

    @model_validator(mode="after")
    def _consistent(self) -> "HardwareFacts":
        # Each is a profile that plans silently wrong: no native dtype, a dtype priced at a made-up
        # 1 TFLOPS, a CPU planned as a GPU (NCCL, CUDA images) or a GPU planned as a CPU.
        if len(set(self.dtypes)) != len(self.dtypes):
            raise ValueError(f"dtypes: {self.dtypes} names a dtype twice")
        missing = [dtype for dtype in self.dtypes if dtype not in self.tflops]
        if missing:
            raise ValueError(f"tflops: no figure for {', '.join(missing)} (one for each of dtypes {self.dtypes})")
        if (self.accelerator == "cpu") != (self.kind == "cpu"):
            raise ValueError(f"kind = {self.kind!r} does not fit accelerator = {self.accelerator!r}: "
                             "the accelerator cpu is kind cpu, and only it")
        for engine, measured in self.measured.items():
            # Measured figures are achieved shares of the peak ones: a figure above its peak would
            # be planned as an efficiency over 100 %.
            for dtype, rate in measured.decode_bandwidth_bytes_per_s.items():
                if rate > self.memory_bandwidth_bytes_per_s:
                    raise ValueError(f"measured.{engine}.decode_bandwidth_bytes_per_s.{dtype} = {rate:g} exceeds "
                                     f"memory_bandwidth_bytes_per_s = {self.memory_bandwidth_bytes_per_s:g}; raise the peak")
            for key in ("prefill_tflops", "decode_tflops"):
                for dtype, rate in getattr(measured, key).items():
                    if rate > self.tflops.get(dtype, float("inf")):
                        raise ValueError(f"measured.{engine}.{key}.{dtype} = {rate:g} exceeds tflops.{dtype} = "
                                         f"{self.tflops[dtype]:g}; raise the peak")
        return self


class EngineEfficiency(_Facts):
    """Measured-derived efficiency figures for one engine on one kind of hardware."""

    decode_bandwidth: float = Field(gt=0, le=1, description="Share of peak memory bandwidth a decode step achieves.")
    prefill_compute: float = Field(gt=0, le=1, description="Share of peak TFLOPS a prefill achieves (MFU).")
    step_overhead_ms: float = Field(ge=0, description="Fixed per-step cost: kernel launches, Python, sampling.")
    layer_overhead_ms: float = Field(default=0.0, ge=0, description="Fixed cost per transformer layer per step (kernel launches, syncs): why small shards stop speeding up.")
    moe_layer_overhead_ms: float = Field(default=0.0, ge=0, description="Fixed cost per MoE block per step beyond its experts' bytes: the router, top-k, token alignment and grouped-GEMM kernels, each at its minimum time at decode-sized batches, ms.")
    tp_efficiency: float = Field(gt=0, le=1, description="Bandwidth efficiency kept per doubling of the TP degree.")
    allreduce_efficiency: float = Field(default=0.7, gt=0, le=1, description="Achieved share of interconnect bandwidth in all-reduce.")
    allreduce_overhead_us: float = Field(default=0.0, ge=0, description="Host-side cost the engine adds to each all-reduce call (eager kernel launch, stream synchronisation), microseconds; ~0 under CUDA graphs.")
    prefill_overhead_ms: float = Field(default=0.0, ge=0, description="Fixed cost of a prefill beyond the per-pass step and layer overheads (context-encoding graph launch, padding to a compiled bucket), ms.")
    custom_allreduce_base_us: float | None = Field(default=None, ge=0, description="The engine's own all-reduce kernels (vLLM's custom all-reduce): fixed cost per stage, microseconds; None = the engine all-reduces through NCCL/gloo only.")
    request_overhead_ms: float = Field(default=0.0, ge=0, description="What each request pays outside the engine's steps: the HTTP server, the hop to the engine process, detokenizing the first token, ms (TTFT).")
    tokenize_us_per_token: float = Field(default=0.0, ge=0, description="Tokenizing the prompt in the server, microseconds per prompt token (TTFT).")
    decode_compute: float | None = Field(default=None, gt=0, le=1, description="Share of peak TFLOPS the decode step's skinny GEMMs reach (batch rows only); None = prefill_compute.")
    runtime_overhead_bytes: int = Field(ge=0, description="Per device: CUDA context / Neuron runtime, allocator slack.")
    comm_buffer_bytes: int = Field(default=0, ge=0, description="Per device when TP>1: NCCL/collective buffers.")
    load_efficiency: float = Field(default=1.0, gt=0, le=1, description="Share of load bandwidth reached when loading weights.")
    graph_memory_bytes: int = Field(default=0, ge=0, description="Per device: the CUDA-graph pool of captured decode steps (vLLM).")
    start_seconds: float = Field(default=0.0, ge=0, description="Engine start-up beyond reading the weights: profiling, compile, graph capture (vLLM).")
    source: str = Field(description="The measurements these figures were calibrated on.")


class EngineFacts(_Facts):
    """What an engine can do: families, dtypes, TP constraints, loading, efficiency."""

    name: Literal["deepspeed", "hf", "neuronx", "vllm"]
    hardware: list[DeviceKind] = Field(description="Device kinds the engine runs on.")
    families: list[Family] = Field(description="Model families the engine serves (at any TP degree where the list of architectures is also given).")
    architectures: Literal["vllm", "transformers"] | None = Field(default=None, description="Beside `families`: every architecture the pinned vLLM registers, or every one transformers' AutoModelForCausalLM builds (data/engines/*.txt, generated from the installed packages).")
    any_architecture_tp: list[int] | None = Field(default=None, description="TP degrees an architecture outside `families` may use (the hf engine: [1], lmc has no layout for it); None = any.")
    checkpoint_quantizations: list[str] = Field(default_factory=list, description="quant_methods of pre-quantized checkpoints the engine loads as they are (vLLM: fp8, mxfp4, awq, gptq, compressed-tensors, bitsandbytes).")
    refused_families: dict[Family, str] = Field(default_factory=dict, description="Families the engine cannot serve, with the reason a plan gives.")
    head_sizes: dict[str, list[int]] = Field(default_factory=dict, description="Attention head sizes the engine has kernels for, per hardware kind; absent = any.")
    dtypes: list[DtypeName] = Field(description="Weight dtypes the engine can serve.")
    kernel_injection_families: list[Family] = Field(default_factory=list, description="Families DeepSpeed has fused kernels (an injection policy) for.")
    kernel_injection: bool = Field(default=True, description="Whether lmc's runtime injects those kernels (false where DeepSpeed's policies do not fit the transformers lmc pins; every family then runs unfused).")
    tp_degrees: dict[str, list[int]] = Field(default_factory=dict, description="Allowed TP degrees per accelerator (Neuron); empty = any divisor.")
    tp_requires_heads_divisible: bool = Field(default=True, description="TP must divide attention heads.")
    heads_divisible_families: list[Family] = Field(default_factory=list, description="Families for which TP must divide the heads even though the engine pads other families' heads.")
    quantization_families: list[Family] | None = Field(default=None, description="Families the engine can serve in int8/fp8; None = all its families.")
    tp_kv_heads_rule: Literal["divide", "divide_or_replicate"] = Field(default="divide_or_replicate", description="KV heads split across ranks, or kept whole and replicated when TP exceeds them.")
    shards_lm_head: bool = Field(default=True, description="Whether the LM head is split across TP ranks (else replicated).")
    prepartitioned_loading: bool = Field(description="Can load weights pre-split per TP rank.")
    pipeline_families: list[Family] = Field(default_factory=list, description="Families the engine can split into pipeline stages across instances (empty = none).")
    pipeline_any_architecture: bool = Field(default=False, description="The engine splits any architecture it runs into pipeline stages across instances (vLLM's multi-node mode).")
    aot_compile_families: list[Family] = Field(default_factory=list, description="Families whose graphs can be compiled and serialized ahead of time (Neuron).")
    compile_seconds_per_billion_params: float = Field(default=0, ge=0, description="Graph compile time, when compilation happens at start (Neuron).")
    efficiency: dict[DeviceKind, EngineEfficiency] = Field(description="Efficiency figures per device kind.")
    unfused_efficiency: dict[DeviceKind, EngineEfficiency] = Field(default_factory=dict, description="Efficiency for families without fused kernels (DeepSpeed AutoTP); empty = same as `efficiency`.")
    source: str = Field(description="Documentation for the capabilities.")

    def fused(self, family: str) -> bool:
        """Whether this engine serves `family` with fused kernels (DeepSpeed kernel injection) in lmc's runtime."""
        return self.kernel_injection and family in self.kernel_injection_families


ModelFacts.model_rebuild()
SpeculativeFacts.model_rebuild()
