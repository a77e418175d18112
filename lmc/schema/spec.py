"""The v1 deployment spec: strict models that mirror the TOML. Unset means unset."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from lmc.schema.units import parse_size

Engine = Literal["deepspeed", "hf", "neuronx", "vllm"]
Dtype = Literal["fp32", "fp16", "bf16", "int8", "fp8"]
# The formats of checkpoints quantized beforehand that a plan's dtype may show (planner facts' DTYPE_BYTES).
CHECKPOINT_FORMATS = ("mxfp4", "int4")
Task = Literal["text-generation", "text2text-generation"]
Optimize = Literal["latency", "throughput", "cost"]
SpeculativeMethod = Literal["ngram", "draft", "eagle3", "mtp"]
_HUB_ID = r"^[A-Za-z0-9][A-Za-z0-9._/+-]*$"
_SIZE_SCHEMA = {
    "anyOf": [
        {"type": "integer", "exclusiveMinimum": 0},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGT]i?B|B)\s*$"},
    ]
}
ByteSize = Annotated[int, BeforeValidator(parse_size), Field(gt=0), WithJsonSchema(_SIZE_SCHEMA)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """What to serve: a Hugging Face model, and where its facts and weights come from.

    The planner reads the model's facts (config.json and the safetensors headers) from `path` when it is
    given, else from the Hugging Face Hub through huggingface_hub (HF_TOKEN, HF_HOME, HF_HUB_OFFLINE and
    HF_ENDPOINT are honoured), else from the built-in catalog's copy of the published config.json
    (docs/catalog.md). `lmc build` packs the weights from `path`, or downloads the planned commit from the
    Hub, unless `uri` leaves them remote.
    """

    id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/+-]*$",
                    examples=["Qwen/Qwen3-8B"],
                    description="The model's Hugging Face Hub id (letters, digits, . _ - + /); its facts come from `path` when given, else the Hub, else the built-in catalog.")
    path: str | None = Field(default=None, min_length=1, examples=["models/qwen3-8b"],
                             description="A local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), relative to the spec file; the facts and the packed weights come from it.")
    uri: str | None = Field(default=None, min_length=1, examples=["s3://my-bucket/qwen3-8b/"],
                            description="Where the container loads the weights from instead of the artifact (s3://...): `lmc build` packs none and serving.properties names it as option.model_id.")
    revision: str | None = Field(default=None, min_length=1, examples=["main"],
                                 description="A Hub branch, tag or commit to plan and build from (default: the main branch); the plan records the commit it read, and the catalog is not used when it is set.")
    task: Task = Field(default="text-generation", examples=["text2text-generation"],
                       description='"text-generation" for decoder-only models, "text2text-generation" for encoder-decoders (the T5 family); the planner refuses the one that does not match the model.')
    trust_remote_code: bool = Field(default=False, examples=[True],
                                    description="Let a stock LMI container run modelling code shipped with the checkpoint (serving.properties' option.trust_remote_code); `lmc runtime` does not read it and runs only the architectures transformers and vLLM ship.")


class TargetSpec(_Strict):
    """Where to serve it: the hardware of one instance, and how many instances the plan may use.

    Name the hardware one way: `instance` (a catalog instance type, or "local"), or `accelerator` with
    `devices`. The catalog (docs/catalog.md) gives each device's memory, bandwidth, compute and price; a
    `profile` measured by `lmc calibrate` replaces those figures with this machine's.
    """

    instance: str | None = Field(default=None, min_length=1, examples=["ml.g5.12xlarge"],
                                 description='A catalog instance type, SageMaker (ml.g5.12xlarge) or EC2 (g5.12xlarge) name, or "local": the CPU of the machine lmc runs on (tensor-parallel ranks are processes over gloo).')
    accelerator: str | None = Field(default=None, min_length=1, examples=["a10g"],
                                    description="A catalog accelerator (t4, a10g, l4, l40s, a100-40gb, a100-80gb, h100-80gb, h200, inferentia2, trainium, ...) instead of an instance type; needs `devices`.")
    devices: int | None = Field(default=None, ge=1, le=1024, examples=[4],
                                description="How many of `accelerator` one instance has; needs `accelerator`.")
    instances: int = Field(default=1, ge=1, le=1024, examples=[2],
                           description="The most instances the plan may use: for replicas, for pipeline stages when a model copy does not fit one instance, and as the autoscaling upper bound.")
    profile: str | None = Field(default=None, min_length=1, examples=["profile.toml"],
                                description="A measured hardware profile (`lmc calibrate --out`, the catalog-entry format), relative to the spec file; the planner predicts from its figures instead of the catalog's.")

    @model_validator(mode="after")
    def _one_way_to_name_hardware(self) -> "TargetSpec":
        if self.instance is not None and (self.accelerator is not None or self.devices is not None):
            raise ValueError("give either `instance` or `accelerator` with `devices`, not both")
        if self.accelerator is not None and self.devices is None:
            raise ValueError("`accelerator` needs `devices` (how many)")
        if self.devices is not None and self.accelerator is None:
            raise ValueError("`devices` needs `accelerator` (which one)")
        if self.instance is None and self.accelerator is None:
            raise ValueError('name the hardware: `instance = "ml.g5.12xlarge"` (or "local"), or `accelerator` with `devices`')
        return self


class BudgetSpec(_Strict):
    """How much of the hardware the plan may use. These are hard limits: a layout over either is rejected,
    and when none is left `lmc plan` exits 3 naming the nearest options.
    """

    memory_fraction: float = Field(default=0.9, gt=0, le=1, examples=[0.85],
                                   description="Share of each device's memory the plan may fill (weights, KV cache, activations and runtime overhead together).")
    memory_per_device: ByteSize | None = Field(default=None, examples=["20GiB"],
                                               description='An absolute cap per device, "20GiB" (2^30 bytes), "20GB" (10^9 bytes), "512MiB" or integer bytes; the lower of it and memory_fraction applies.')
    max_cost_per_hour: float | None = Field(default=None, gt=0, examples=[12.0],
                                            description="The most all the plan's instances may cost together, USD per hour at catalog prices; dearer layouts are rejected.")


class GoalSpec(_Strict):
    """What the deployment must achieve. Goals are soft: when something fits but nothing meets them, the
    plan is the closest one, with `goal_met: false` (exit 0); only the budget and what the engines can run make a spec infeasible (exit 3).
    """

    tpot_ms: float | None = Field(default=None, gt=0, examples=[50],
                                  description="Time per output token (p50) at the planned batch, in milliseconds; unset: no TPOT goal.")
    ttft_ms: float | None = Field(default=None, gt=0, examples=[1000],
                                  description="Time to first token for a max_input_tokens prompt, in milliseconds; unset: no TTFT goal.")
    optimize: Optimize = Field(default="latency", examples=["throughput"],
                               description='What to prefer among plans that meet the goals, after holding the concurrency and 16-bit precision: "latency" (lowest TPOT), "throughput" (most output tokens per second) or "cost" (lowest USD per million tokens); also the batch delay (10 ms for latency, 50 ms otherwise).')


class WorkloadSpec(_Strict):
    """The traffic to plan for: request lengths size the sequence length and the KV cache, concurrency the
    batches and replicas, request rates the instance count and autoscaling bounds.
    """

    max_input_tokens: int = Field(default=1024, ge=1, le=1_048_576, examples=[2048],
                                  description="Longest prompt, in tokens; with max_output_tokens, the sequence length the plan sizes the KV cache for (at most the model's positions).")
    max_output_tokens: int = Field(default=256, ge=1, le=1_048_576, examples=[512],
                                   description="Longest generation, in tokens.")
    concurrency: int = Field(default=1, ge=1, le=100_000, examples=[16],
                             description="Requests in flight at once that the plan must hold (replicas × batch) and meet the goals at.")
    requests_per_second: float | None = Field(default=None, gt=0, le=1_000_000, examples=[2.5],
                                              description="Steady request rate to carry; sizes the instance count (a request holds its replica for TTFT + (max_output_tokens − 1) × TPOT).")
    peak_requests_per_second: float | None = Field(default=None, gt=0, le=1_000_000, examples=[10.0],
                                                   description="Peak request rate; sizes the autoscaling upper bound (needs requests_per_second, and is at least it).")

    @model_validator(mode="after")
    def _peak_above_rate(self) -> "WorkloadSpec":
        if self.peak_requests_per_second is not None:
            if self.requests_per_second is None:
                raise ValueError("`peak_requests_per_second` needs `requests_per_second` (the steady rate)")
            if self.peak_requests_per_second < self.requests_per_second:
                raise ValueError(f"`peak_requests_per_second` ({self.peak_requests_per_second:g}) is below "
                                 f"`requests_per_second` ({self.requests_per_second:g}); the peak is the higher rate")
        return self


class PinSpec(_Strict):
    """Choices fixed by the user; the planner checks them against the model and hardware, refuses a pin
    that cannot run with the reason, and explains the consequences (`lmc plan --explain`). Unset: the
    planner chooses.
    """

    engine: Engine | None = Field(default=None, examples=["vllm"],
                                  description='Serve with this engine only: "vllm" (GPUs, CPU), "hf" (HF transformers: CPU, GPUs), "deepspeed" (NVIDIA GPUs) or "neuronx" (Inferentia2, Trainium).')
    dtype: Dtype | None = Field(default=None, examples=["bf16"],
                                description="The weights' dtype: fp32, fp16, bf16, int8 (weight-only, per-channel scales) or fp8 (vLLM's online quantization: fp8 matmuls where the GPU has fp8, weight-only Marlin kernels on other GPUs; other engines only where the hardware has fp8).")
    tensor_parallel_degree: int | None = Field(default=None, ge=1, le=1024, examples=[2],
                                               description="Devices one model copy (one pipeline stage) is split across by tensor parallelism; it must divide what the engine splits (attention heads) and fit the instance's devices.")
    replicas: int | None = Field(default=None, ge=1, le=100_000, examples=[2],
                                 description="Model copies across the instances, each of tensor_parallel_degree devices (× pipeline stages).")
    pipeline_parallel_degree: int | None = Field(default=None, ge=1, le=64, examples=[2],
                                                 description="Pipeline stages per model copy, one instance each (vLLM across instances); without it, stages are tried only when a copy does not fit one instance.")
    expert_parallel: bool | None = Field(default=None, examples=[True], description="vLLM, mixture-of-experts models: whole experts on each tensor-parallel rank (vLLM's enable_expert_parallel) instead of every expert split across the ranks.")
    kv_cache_dtype: Literal["auto", "fp8"] | None = Field(default=None, examples=["fp8"], description="vLLM --kv-cache-dtype: auto (the compute dtype) or fp8 (one byte per cached element: twice the sequences in the pool; GPUs with fp8: Hopper, Ada, Blackwell). Unset: fp8 where the GPU has it and a compute-dtype pool would hold fewer sequences than the concurrency asks.")
    data_parallel_degree: int | None = Field(default=None, ge=1, le=1024, examples=[2], description="vLLM --data-parallel-size: groups of tensor_parallel_degree ranks per model copy, each with its own attention, KV pool and max_num_seqs, behind one endpoint; mixture-of-experts models spread their experts over all the groups' ranks (expert parallel). On GPUs the groups may span instances. 1: none.")

    @field_validator("dtype", mode="before")
    @classmethod
    def _checkpoint_formats_are_not_pinned(cls, value):
        # A plan's dtype also names a quantized checkpoint's own format (mxfp4, int4), which is read from the
        # checkpoint, not chosen: say so instead of listing the dtypes lmc chooses between.
        if value in CHECKPOINT_FORMATS:
            raise ValueError(f"{value} is a quantized checkpoint's own format, which lmc reads from the checkpoint and "
                             "serves as it is; leave pin.dtype unset (or name the quantized checkpoint in model.id)")
        return value


class ServingSpec(_Strict):
    """What the server offers beyond generation: vLLM's OpenAI-server options. Setting one makes the plan a
    vLLM one (the other engines are refused with that reason); the names are checked at plan time against
    the parsers the pinned vLLM registers (lmc/planner/data/engines/vllm_tool_parsers.txt and
    vllm_reasoning_parsers.txt).
    """

    tool_call_parser: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                                         examples=["hermes"],
                                         description="Tool calling: the parser vLLM reads the model's tool calls with (vLLM's --tool-call-parser with --enable-auto-tool-choice: hermes, llama3_json, pythonic, mistral, qwen3_xml, ...). Needs the vllm engine.")
    reasoning_parser: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                                         examples=["qwen3"],
                                         description="Reasoning models: the parser that separates the reasoning from the answer (vLLM's --reasoning-parser: deepseek_r1, qwen3, gpt_oss, ...). Needs the vllm engine.")


class AdapterSpec(_Strict):
    """A LoRA adapter served beside the base model (vllm engine)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="The name clients select it by: `model` on the OpenAI routes, `adapters` or the X-Amzn-SageMaker-Adapter-Identifier header on /invocations.")
    path: str | None = Field(default=None, min_length=1, description="A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), relative to the spec file.")
    id: str | None = Field(default=None, min_length=1, max_length=200, pattern=_HUB_ID,
                           description="Or a Hub id of a PEFT LoRA repo, resolved like model.id.")
    revision: str | None = Field(default=None, min_length=1, description="With `id`: a branch, tag or commit; the plan records the commit it read.")

    @model_validator(mode="after")
    def _one_source(self) -> "AdapterSpec":
        if (self.path is None) == (self.id is None):
            raise ValueError("give the adapter's files as either `path` (a PEFT directory) or `id` (a Hub repo), one of them")
        if self.revision is not None and self.id is None:
            raise ValueError("`revision` goes with `id` (a Hub repo); a `path` is read as it is")
        return self


class SpeculativeSpec(_Strict):
    """Speculative decoding (vllm engine: vLLM's --speculative-config)."""

    method: SpeculativeMethod = Field(description="ngram (prompt lookup), draft (a smaller model), eagle3 (an EAGLE-3 head) or mtp (the checkpoint's multi-token-prediction layers).")
    num_tokens: int = Field(ge=1, le=16, description="Tokens proposed per step (vLLM's num_speculative_tokens).")
    model: str | None = Field(default=None, min_length=1, description="draft and eagle3: the draft model or EAGLE-3 head, a Hub id or a path relative to the spec file.")
    acceptance_rate: float | None = Field(default=None, gt=0, lt=1, description="Expected share of proposed tokens accepted (per token); the planner predicts TPOT from it, else from a published figure per method.")

    @model_validator(mode="after")
    def _model_where_needed(self) -> "SpeculativeSpec":
        if self.method in ("draft", "eagle3") and self.model is None:
            raise ValueError(f"method {self.method!r} needs `model` (the {'draft model' if self.method == 'draft' else 'EAGLE-3 head'}: a Hub id or a path)")
        if self.method in ("ngram", "mtp") and self.model is not None:
            what = "the prompt itself" if self.method == "ngram" else "the checkpoint's own MTP layers"
            raise ValueError(f"method {self.method!r} proposes from {what}: remove `model` (or use method \"draft\" or \"eagle3\")")
        return self


class DeploySpec(_Strict):
    """Account-specific values for `lmc deploy` (docs/deploy.md). Where unset, the files carry
    REPLACE_ME placeholders that keep the value's shape, and `lmc deploy` names them; the flags
    `--name`, `--image`, `--role` and `--model-data` override these keys.
    """

    name: str | None = Field(default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
                             examples=["qwen3-8b"],
                             description="Name of the SageMaker model, endpoint config and endpoint, and of the Kubernetes and KServe resources (lower-case letters, digits, -); default: the spec's file name.")
    image: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^\S+$",
                              examples=["123456789012.dkr.ecr.us-east-1.amazonaws.com/lmc-runtime:0.1.0"],
                              description="The container image that runs `lmc runtime` (docker/ builds one), in every target's files.")
    role_arn: str | None = Field(default=None, min_length=20, max_length=2048, pattern=r"^arn:aws[a-z-]*:iam::\d{12}:role/.+$",
                                 examples=["arn:aws:iam::123456789012:role/SageMakerExecutionRole"],
                                 description="IAM role that reads the model data: SageMaker's execution role (CreateModel's ExecutionRoleArn, also to pull the image), or on Kubernetes and KServe the role of the pods' service account (EKS IRSA annotation).")
    model_data: str | None = Field(default=None, min_length=1, max_length=1024, pattern=r"^(s3|https)://.+",
                                   examples=["s3://my-bucket/lmc/qwen3-8b/model/"],
                                   description="Where the built artifact was uploaded: a model.tar.gz (SageMaker's ModelDataUrl) or, ending otherwise, an S3 prefix of `lmc build --format dir` (uncompressed, what AWS recommends for large models); the Kubernetes init container and KServe's storage initializer fetch it too.")
    service_account: str | None = Field(default=None, min_length=1, max_length=253,
                                        pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$",
                                        examples=["qwen3-8b"],
                                        description="Kubernetes service account the pods run as (default: `name`); lmc deploy writes it with role_arn's IRSA annotation.")


class Spec(_Strict):
    """A deployment spec (format v1)."""

    model: ModelSpec
    target: TargetSpec
    budget: BudgetSpec = BudgetSpec()
    goal: GoalSpec = GoalSpec()
    workload: WorkloadSpec = WorkloadSpec()
    pin: PinSpec = PinSpec()
    serving: ServingSpec = ServingSpec()
    deploy: DeploySpec = DeploySpec()
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=256, description="LoRA adapters served beside the base model (vllm engine); names are unique and differ from model.id.")
    speculative: SpeculativeSpec | None = None

