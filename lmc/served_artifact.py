"""Where an artifact keeps what it serves beside the base model, and how vLLM is told: one set of
conventions for the build (lmc.emitters), serving.properties and the runtime (lmc.runtime.vllm_backend).

    adapters/<name>/adapter_config.json, adapter_model.safetensors   LoRA adapters (DJL Serving's "adapters
                                                                     local directory": LMI loads each at start)
    draft/config.json, *.safetensors, tokenizer files               a draft model or EAGLE-3 head

vLLM's side, from the plan's `lora` and `speculative` sections: --enable-lora, --max-loras, --max-lora-rank,
--max-cpu-loras, --lora-modules name=path; --speculative-config {"method", "num_speculative_tokens",
"model"} when the plan kept speculation on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

ADAPTERS_DIR = "adapters"
DRAFT_DIR = "draft"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_names(plan: Mapping[str, Any]) -> list[str]:
    """The adapters the plan serves, in the spec's order."""
    return [str(adapter["name"]) for adapter in (plan.get("lora") or {}).get("adapters", [])]


def lora_engine_arguments(plan: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's LoRA engine arguments (AsyncEngineArgs keywords); empty without adapters."""
    lora = plan.get("lora")
    if not lora:
        return {}
    return {"enable_lora": True, "max_loras": int(lora["max_loras"]), "max_lora_rank": int(lora["max_lora_rank"]),
            "max_cpu_loras": int(lora["max_cpu_loras"])}


def lora_modules(plan: Mapping[str, Any], model_dir: Path | str) -> list[str]:
    """vLLM's --lora-modules values: name=path of each packed adapter."""
    return [f"{name}={Path(model_dir) / ADAPTERS_DIR / name}" for name in adapter_names(plan)]


def speculative_config(plan: Mapping[str, Any], model_dir: Path | str) -> dict[str, Any] | None:
    """vLLM's --speculative-config as the plan decided (None: no speculation, or turned off by the plan)."""
    section = plan.get("speculative")
    if not section or not section.get("enabled"):
        return None
    config: dict[str, Any] = {"method": section["vllm_method"], "num_speculative_tokens": int(section["num_tokens"])}
    if section.get("model") is not None:
        config["model"] = str(Path(model_dir) / DRAFT_DIR)
    return config
