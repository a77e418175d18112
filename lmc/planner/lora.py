"""LoRA adapters in the plan: their fit to the base model, vLLM's LoRA slots, their cost per decode step.

vLLM (vllm/lora/layers) wraps every LoRA-capable linear layer of the base once, at start, and gives each
a stacked buffer per slot: `max_loras` slots of rank `max_lora_rank`, in the compute dtype, allocated
whatever modules the adapters target (a module an adapter leaves alone holds zeros). Column-parallel
layers (q/k/v, gate/up) hold A whole (rank × in) and B split over TP (out/TP × rank); row-parallel layers
(o, down) hold A split (rank × in/TP) and B whole (out × rank). Those slots are weights to vLLM's
profiler, so they come out of the KV pool. `max_cpu_loras` adapters wait in host memory, loaded once.

Cost per decode step: punica's SGMV kernels (Chen et al., "Punica: Multi-Tenant LoRA Serving",
arXiv:2310.18547), which vLLM's LoRA layers run, apply each token's adapter as two skinny GEMMs
(shrink x·A, expand ·B) over every wrapped module, batched across adapters. Per step that reads the
slots of the distinct adapters in the batch and computes 2 · rank · (in + out) FLOPs per token and
module: memory and compute terms of lmc's latency model (bandwidth and TFLOPS of the rank), no fitted
constant. The batch's adapters are taken as uniform traffic: N · (1 − (1 − 1/N)^B) distinct of N.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmc.errors import SpecValueError
from lmc.planner.facts import DTYPE_BYTES, EngineFacts, HardwareFacts, ModelFacts

# vLLM's allowed --max-lora-rank values (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Module names of the decoders vLLM applies LoRA to under these names (Llama, Mistral, Qwen, Gemma, Phi-3 and
# most others): the attention projections and the gated MLP.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Families whose checkpoints use other names (GPT-J, GPT-NeoX, OPT, BLOOM, T5): adapters are not checked
# against these names there.
OTHER_NAMES = ("gptj", "gpt_neox", "opt", "bloom", "t5")


@dataclass(frozen=True)
class LoraSlots:
    """vLLM's LoRA engine arguments as the plan sets them."""

    max_loras: int  # adapters in one batch (slots on each device)
    max_lora_rank: int  # the slots' rank: the smallest vLLM allows at or above every adapter's
    max_cpu_loras: int  # adapters held in host memory: all of them, loaded once at start


def module_widths(model: ModelFacts) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA-capable module, whole (before TP)."""
    h, q, kv, i = (model.hidden_size, model.attention_heads * model.head_dim, model.kv_heads * model.head_dim,
                   model.intermediate_size)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def named_modules(modules: tuple[str, ...]) -> list[str]:
    """Target modules as vLLM's unfused names (qkv_proj → q_proj, k_proj, v_proj)."""
    out: list[str] = []
    for name in modules:
        out += FUSED.get(name.rsplit(".", 1)[-1], (name.rsplit(".", 1)[-1],))
    return out


def check_adapters(model: ModelFacts, where: list[tuple[str, str]]) -> None:
    """Each adapter fits the base: trained on it (by name), a rank vLLM serves, modules the base has.
    `where`: each adapter's spec key (adapters.N.path or .id) and value, for the one-line error."""
    for adapter, (key, value) in zip(model.adapters, where):
        if adapter.base_model and _base_name(adapter.base_model) != _base_name(model.id):
            raise SpecValueError(key, value, f"adapter {adapter.name!r} was trained on {adapter.base_model} "
                                             f"(adapter_config.json base_model_name_or_path), not {model.id}; serve it "
                                             "on that base, or fix base_model_name_or_path if it names the same weights")
        if adapter.rank > VLLM_LORA_RANKS[-1]:
            raise SpecValueError(key, value, f"adapter {adapter.name!r} has rank {adapter.rank}; vLLM serves ranks up "
                                             f"to {VLLM_LORA_RANKS[-1]} (--max-lora-rank)")
        if model.family in OTHER_NAMES or model.kv_lora_rank:
            continue
        known = module_widths(model)
        unknown = [name for name in named_modules(adapter.target_modules) if name not in known]
        if unknown:
            raise SpecValueError(key, value, f"adapter {adapter.name!r} targets {unknown[0]}, which {model.id} "
                                             f"({model.family}) has no LoRA-capable module of; it has "
                                             f"{', '.join(known)}")


def _base_name(name: str) -> str:
    """A base model's name without its org or local directory, case-folded: the part a rename keeps."""
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def lora_slots(model: ModelFacts, max_num_seqs: int) -> LoraSlots | None:
    """Slots for every adapter to be in one batch (at most max_num_seqs of them), of the largest rank."""
    if not model.adapters:
        return None
    rank = max(adapter.rank for adapter in model.adapters)
    slot_rank = next(r for r in VLLM_LORA_RANKS if r >= rank)
    count = len(model.adapters)
    return LoraSlots(max_loras=min(count, max_num_seqs), max_lora_rank=slot_rank, max_cpu_loras=count)


def slot_elements(model: ModelFacts, rank: int, tp: int) -> int:
    """Elements of one slot on one rank over every layer (module docstring's column/row split)."""
    widths = module_widths(model)
    per_layer = 0
    for name, (d_in, d_out) in widths.items():
        column = name not in ("o_proj", "down_proj")
        elements = rank * d_in + rank * d_out // tp if column else rank * d_in // tp + rank * d_out
        if name in MLP and model.num_experts > 1:  # vLLM's MoE LoRA holds a slot per expert
            elements *= model.num_experts
        per_layer += elements
    return per_layer * model.layers


def slot_bytes(model: ModelFacts, act_dtype: str, tp: int, max_num_seqs: int) -> int:
    """Bytes per device of vLLM's LoRA slots (0 without adapters)."""
    slots = lora_slots(model, max_num_seqs)
    if slots is None:
        return 0
    return int(slots.max_loras * slot_elements(model, slots.max_lora_rank, tp) * DTYPE_BYTES[act_dtype])


def distinct_adapters(count: int, batch: int) -> float:
    """Expected distinct adapters among `batch` sequences spread uniformly over `count` adapters."""
    return count * (1 - (1 - 1 / count) ** batch)


def lora_step_ms(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                 batch: int, max_num_seqs: int, dp: int = 1) -> float:
    """What the LoRA kernels add to one decode step of `batch` sequences (module docstring); 0 without adapters."""
    from lmc.planner.latency import decode_compute, effective_bandwidth, efficiency_for, rank_tflops
    from lmc.planner.memory import compute_dtype

    slots = lora_slots(model, max_num_seqs)
    if slots is None:
        return 0.0
    act = compute_dtype(dtype, model, hardware)
    efficiency = efficiency_for(engine, model, hardware, dtype)
    active = min(distinct_adapters(len(model.adapters), batch), slots.max_loras)
    elements = slot_elements(model, slots.max_lora_rank, tp)
    if model.num_experts > 1:  # a token passes its k experts only
        elements = elements * model.experts_per_token / model.num_experts
    memory_ms = active * elements * DTYPE_BYTES[act] / effective_bandwidth(hardware, efficiency, tp, dp) * 1e3
    flops = 2 * elements * batch
    compute_ms = flops / (rank_tflops(hardware, act, tp, dp) * 1e12 * decode_compute(efficiency)) * 1e3
    return memory_ms + compute_ms


def lora_section(model: ModelFacts, max_num_seqs: int, act_dtype: str, tp: int) -> dict | None:
    """The plan's `lora` section (present only with adapters)."""
    slots = lora_slots(model, max_num_seqs)
    if slots is None:
        return None
    return {
        "max_loras": slots.max_loras, "max_lora_rank": slots.max_lora_rank, "max_cpu_loras": slots.max_cpu_loras,
        "slot_bytes_per_device": slot_bytes(model, act_dtype, tp, max_num_seqs),
        "adapters": [{"name": a.name, "source": a.source, "revision": a.revision, "rank": a.rank,
                      "target_modules": list(a.target_modules), "weight_bytes": a.weight_bytes}
                     for a in model.adapters],
    }


def lora_reason(model: ModelFacts, section: dict, step_ms: float, batch: int) -> str:
    """The `lora` decision's reason: the slots, what they take from the KV pool, their cost per step."""
    ranks = sorted({a.rank for a in model.adapters})
    return (f"{len(model.adapters)} adapter(s) of rank {', '.join(map(str, ranks))}: vLLM --enable-lora with "
            f"--max-loras {section['max_loras']} (every adapter can be in one batch, at most max_num_seqs), "
            f"--max-lora-rank {section['max_lora_rank']} (the smallest vLLM allows at or above the largest rank), "
            f"--max-cpu-loras {section['max_cpu_loras']} (all held in host memory, loaded once); the slots take "
            f"{section['slot_bytes_per_device'] / 2**30:.2f} GiB per device from the KV pool (every LoRA-capable "
            f"linear of every layer, column-parallel A whole, B split over TP); the punica SGMV kernels add "
            f"{step_ms:.3f} ms to a decode step of {batch} (reading the slots of "
            f"{distinct_adapters(len(model.adapters), batch):.1f} distinct adapters, uniform traffic, and 2·r·(in+out) "
            f"FLOPs per token and module; Punica, arXiv:2310.18547)")
