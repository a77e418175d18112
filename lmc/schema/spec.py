"""The v1 deployment spec: strict models that mirror the TOML. Unset means unset."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from lmc.schema.units import parse_size

Engine = Literal["deepspeed", "hf", "neuronx", "vllm"]
Dtype = Literal["fp32", "fp16", "bf16", "int8", "fp8"]
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
    """What to serve."""

    id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/+-]*$",
                    description="Model id (HF hub style: letters, digits, . _ - + /); facts come from `path` when given, else the catalog.")
    path: str | None = Field(default=None, min_length=1, description="Local HF checkpoint directory, relative to the spec file.")
    uri: str | None = Field(default=None, min_length=1, description="Remote weights (s3://...) the container loads instead of packed weights.")
    revision: str | None = Field(default=None, min_length=1, description="Checkpoint revision, recorded in the artifact.")
    task: Task = Field(default="text-generation", description="text-generation (decoder-only) or text2text-generation (T5 family).")
    trust_remote_code: bool = Field(default=False, description="Allow the checkpoint's own modelling code.")


class TargetSpec(_Strict):
    """Where to serve it."""

    instance: str | None = Field(default=None, min_length=1, description='A catalog instance (ml.g5.12xlarge, g5.12xlarge) or "local".')
    accelerator: str | None = Field(default=None, min_length=1, description="A catalog accelerator (a10g, a100-40gb, ...), with `devices`.")
    devices: int | None = Field(default=None, ge=1, le=1024, description="How many accelerators, with `accelerator`.")
    instances: int = Field(default=1, ge=1, le=1024, description="The most instances the plan may use (replicas, pipeline stages, autoscaling).")
    profile: str | None = Field(default=None, min_length=1, description="A measured hardware profile (catalog-entry format), relative to the spec file.")

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
    """How much of the hardware the plan may use."""

    memory_fraction: float = Field(default=0.9, gt=0, le=1, description="Share of each device's memory the plan may fill.")
    memory_per_device: ByteSize | None = Field(default=None, description='Absolute cap per device: "20GiB", "20GB" or bytes.')
    max_cost_per_hour: float | None = Field(default=None, gt=0, description="USD per hour for all instances together.")


class GoalSpec(_Strict):
    """What the deployment must achieve."""

    tpot_ms: float | None = Field(default=None, gt=0, description="Time per output token (p50) at the planned batch, ms.")
    ttft_ms: float | None = Field(default=None, gt=0, description="Time to first token for a max_input_tokens prompt, ms.")
    optimize: Optimize = Field(default="latency", description="What to prefer among plans that meet the goal.")


class WorkloadSpec(_Strict):
    """The traffic to plan for."""

    max_input_tokens: int = Field(default=1024, ge=1, le=1_048_576, description="Longest prompt, tokens.")
    max_output_tokens: int = Field(default=256, ge=1, le=1_048_576, description="Longest generation, tokens.")
    concurrency: int = Field(default=1, ge=1, le=100_000, description="Concurrent requests to serve.")
    requests_per_second: float | None = Field(default=None, gt=0, le=1_000_000, description="Steady request rate to carry; sizes the instance count.")
    peak_requests_per_second: float | None = Field(default=None, gt=0, le=1_000_000, description="Peak request rate; sizes the autoscaling upper bound (needs requests_per_second).")

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
    """Choices fixed by the user; the planner checks them and explains the consequences."""

    engine: Engine | None = Field(default=None, description="Serving engine.")
    dtype: Dtype | None = Field(default=None, description="Weight dtype; int8 is weight-only quantization.")
    tensor_parallel_degree: int | None = Field(default=None, ge=1, le=1024, description="Devices per replica.")
    replicas: int | None = Field(default=None, ge=1, le=100_000, description="Model copies across the instances.")
    pipeline_parallel_degree: int | None = Field(default=None, ge=1, le=64, description="Pipeline stages, one instance each, per model copy.")
    expert_parallel: bool | None = Field(default=None, description="vLLM, mixture-of-experts models: whole experts on each tensor-parallel rank (vLLM's enable_expert_parallel) instead of every expert split across the ranks.")
    data_parallel_degree: int | None = Field(default=None, ge=1, le=1024, description="vLLM --data-parallel-size: groups of tensor_parallel_degree ranks per model copy, each with its own attention, KV pool and max_num_seqs, behind one endpoint; mixture-of-experts models spread their experts over all the groups' ranks (expert parallel). On GPUs the groups may span instances. 1: none.")


class ServingSpec(_Strict):
    """What the server offers beyond generation (vLLM plans: vLLM's OpenAI server options)."""

    tool_call_parser: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                                         description="Tool calling: the parser vLLM reads the model's tool calls with (vLLM's --tool-call-parser: hermes, llama3_json, pythonic, mistral, qwen3_xml, ...); enables automatic tool choice. Needs the vllm engine.")
    reasoning_parser: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
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
    """Account-specific values for `lmc deploy`; where unset, the files carry marked placeholders."""

    name: str | None = Field(default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
                             description="Name of the model, endpoint and Kubernetes resources (lower case, digits, -).")
    image: str | None = Field(default=None, min_length=1, max_length=255, description="Container image URI that runs `lmc runtime`.")
    role_arn: str | None = Field(default=None, min_length=20, max_length=2048, pattern=r"^arn:aws[a-z-]*:iam::\d{12}:role/.+$",
                                 description="SageMaker execution role ARN.")
    model_data: str | None = Field(default=None, min_length=1, max_length=1024, pattern=r"^(s3|https)://.+",
                                   description="Where the built artifact lives (s3://bucket/prefix/model.tar.gz).")


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

