"""The Plan: fully resolved and frozen. Its JSON is the contract of `lmc plan --json`."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanModel(_Frozen):
    id: str
    family: str
    parameters: int
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    vocab_size: int


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


class Decision(_Frozen):
    key: str
    value: str | int | float | bool | None
    reason: str


class Alternative(_Frozen):
    engine: str
    dtype: str
    tensor_parallel_degree: int
    replicas: int
    verdict: Literal["rejected", "feasible"]
    reason: str


class Plan(_Frozen):
    lmc_version: str
    spec_sha256: str
    plan_sha256: str = ""
    model: PlanModel
    target: PlanTarget
    engine: Literal["deepspeed", "hf", "neuronx"]
    dtype: Literal["fp32", "fp16", "bf16", "int8", "fp8"]
    quantization: str | None
    tensor_parallel_degree: int = Field(ge=1)
    replicas: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    max_batch_delay_ms: int = Field(ge=0)
    job_queue_size: int = Field(ge=1)
    max_sequence_length: int = Field(ge=1)
    memory_per_device: MemoryPerDevice
    predicted: Predicted
    goal_met: bool
    decisions: list[Decision]
    alternatives: list[Alternative]

    def with_digest(self) -> "Plan":
        """The same plan with plan_sha256 set: the digest of its JSON without that field."""
        body = self.model_dump(mode="json")
        body["plan_sha256"] = ""
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        return self.model_copy(update={"plan_sha256": digest})

    def to_json(self) -> str:
        """Stable, readable JSON (key order as in DESIGN.md, 2-space indent, trailing newline)."""
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def decision(self, key: str) -> Decision | None:
        return next((d for d in self.decisions if d.key == key), None)
