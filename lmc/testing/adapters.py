"""Random PEFT LoRA adapters for a tiny checkpoint, written as PEFT saves them (adapter_config.json +
adapter_model.safetensors, tensors named base_model.model.<module>.lora_A/B.weight) without PEFT itself.

Unlike PEFT's initialisation (B = 0, an adapter that changes nothing), both matrices are random, so each
adapter changes the base model's answers: tests can tell adapters apart.
"""

from __future__ import annotations

import json
from pathlib import Path

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_lora_adapter(checkpoint: Path, out_dir: Path, *, rank: int = 8, seed: int = 0,
                      modules: tuple[str, ...] = ATTENTION_MODULES, base_model: str | None = None,
                      scale: float = 1.0) -> Path:
    """An adapter of `rank` over `modules` of every layer of the Llama-style `checkpoint`, written to
    `out_dir` (created). `scale` multiplies B (the adapter's strength)."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    widths = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            where = "self_attn" if module in ATTENTION_MODULES else "mlp"
            d_in, d_out = widths[module]
            prefix = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, d_in ** -0.5, (rank, d_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.normal(0, scale * rank ** -0.5, (d_out, rank))
                                                  .astype(np.float32))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {"base_model_name_or_path": base_model or str(checkpoint), "bias": "none",
                      "fan_in_fan_out": False, "inference_mode": True, "lora_alpha": rank, "lora_dropout": 0.0,
                      "peft_type": "LORA", "r": rank, "target_modules": list(modules), "task_type": "CAUSAL_LM"}
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return out_dir
