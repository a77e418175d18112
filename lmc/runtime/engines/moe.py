"""Mixtral's sparse MoE blocks in the hf engine: hub expert tensors into transformers' fused experts.

Checkpoints (and lmc's shard files) keep the hub names

  <layer>.block_sparse_moe.gate.weight                 router, [experts, hidden], replicated
  <layer>.block_sparse_moe.experts.E.w1.weight         gate projection, [intermediate, hidden], column-split
  <layer>.block_sparse_moe.experts.E.w3.weight         up projection,   [intermediate, hidden], column-split
  <layer>.block_sparse_moe.experts.E.w2.weight         down projection, [hidden, intermediate], row-split

while transformers 5.x builds `<layer>.mlp` with a router `gate.weight` and one fused experts module:
`gate_up_proj` [experts, 2·intermediate, hidden] and `down_proj` [experts, hidden, intermediate]. The
fusion mirrors transformers' own checkpoint conversion (conversion_mapping.py, "mixtral"): per expert
gate_up_proj[E] = cat(w1, w3) on the output dim — gate first, then up, which is how the experts' forward
chunks it — and down_proj[E] = w2.

Tensor parallel: every rank holds each expert's intermediate/TP slice of w1/w3 (rows) and w2 (columns),
so each rank's fused experts compute a partial sum of the very same routed, weighted expert outputs. The
weighted sum over experts is linear in those partials, so one all-reduce of the experts' output per MoE
block makes it exact; the replicated router picks the same experts on every rank.

int8 shards (`<name>_scale`, lmc.emitters.partition): the fused expert weights stay int8 at rest with
their per-output-row scales beside them, and QuantizedExperts dequantizes one expert's matrix per matmul.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lmc.errors import ArtifactError, InternalError

SCALE_SUFFIX = "_scale"
_EXPERT = re.compile(r"^(?P<layer>.+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight"
                     r"(?P<scale>_scale)?$")
_ROUTER = re.compile(r"^(?P<layer>.+)\.block_sparse_moe\.gate\.weight$")
_QUANTIZED = (torch.int8, torch.float8_e4m3fn)


def load_moe_blocks(model: nn.Module, state: dict[str, torch.Tensor], *, world_size: int, group=None) -> None:
    """Move every `block_sparse_moe` tensor out of `state` into the model's MoE blocks (`<layer>.mlp`).

    Raises ArtifactError when a layer's experts are missing, incomplete or of the wrong shape.
    """
    layers: dict[str, dict] = {}
    for name in [n for n in state if ".block_sparse_moe." in n]:
        tensor = state.pop(name)
        if match := _ROUTER.match(name):
            layers.setdefault(match["layer"], {})["router"] = tensor
        elif match := _EXPERT.match(name):
            key = (match["proj"] + SCALE_SUFFIX) if match["scale"] else match["proj"]
            layers.setdefault(match["layer"], {}).setdefault(key, {})[int(match["expert"])] = tensor
        else:
            raise ArtifactError(f"shard tensor {name!r} matches nothing in the model built from config.json")
    blocks = _moe_blocks(model)
    if set(layers) != set(blocks):
        missing = sorted(set(blocks) - set(layers)) or sorted(set(layers) - set(blocks))
        raise ArtifactError(f"shard and config.json disagree on the MoE layers (first odd one: {missing[0]!r})")
    for layer, tensors in layers.items():
        _load_block(blocks[layer], layer, tensors, world_size, group)


def _moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """{checkpoint layer prefix: the layer's MoE block}, for every module with a router and fused experts."""
    return {name.removesuffix(".mlp"): module for name, module in model.named_modules()
            if name.endswith(".mlp") and hasattr(module, "gate") and hasattr(getattr(module, "experts", None),
                                                                               "gate_up_proj")}


def _load_block(block: nn.Module, layer: str, tensors: dict, world_size: int, group) -> None:
    experts = block.experts
    if "router" not in tensors:
        raise ArtifactError(f"shard has no tensor {layer + '.block_sparse_moe.gate.weight'!r}")
    router = tensors["router"]
    if tuple(router.shape) != tuple(block.gate.weight.shape):
        raise ArtifactError(f"shard tensor {layer + '.block_sparse_moe.gate.weight'!r} has shape "
                            f"{tuple(router.shape)}, the model expects {tuple(block.gate.weight.shape)}")
    block.gate.weight = nn.Parameter(router, requires_grad=False)
    w1, w3, w2 = (_per_expert(tensors, layer, proj, experts.num_experts) for proj in ("w1", "w3", "w2"))
    hidden = experts.hidden_dim
    local = w1[0].shape[0]
    for e in range(experts.num_experts):
        expected = {"w1": (local, hidden), "w3": (local, hidden), "w2": (hidden, local)}
        for proj, got in (("w1", w1[e]), ("w3", w3[e]), ("w2", w2[e])):
            if tuple(got.shape) != expected[proj]:
                raise ArtifactError(f"shard tensor {_name(layer, e, proj)!r} has shape {tuple(got.shape)}, "
                                    f"expected {expected[proj]}")
    gate_up = torch.stack([torch.cat([w1[e], w3[e]], dim=0) for e in range(experts.num_experts)])
    down = torch.stack(w2)
    scales = [_per_expert(tensors, layer, proj + SCALE_SUFFIX, experts.num_experts, required=False)
              for proj in ("w1", "w3", "w2")]
    quantized = gate_up.dtype in _QUANTIZED or down.dtype in _QUANTIZED
    if any(s is not None for s in scales) or quantized:
        if any(s is None for s in scales) or not quantized:
            raise ArtifactError(f"{layer}.block_sparse_moe: expert weights and their '{SCALE_SUFFIX}' tensors "
                                "do not match (quantized weights need a scale each, float weights none)")
        w1_scale, w3_scale, w2_scale = scales
        gate_up_scale = torch.stack([torch.cat([w1_scale[e].reshape(-1), w3_scale[e].reshape(-1)])
                                     for e in range(experts.num_experts)])
        down_scale = torch.stack([s.reshape(-1) for s in w2_scale])
        experts = QuantizedExperts(gate_up, gate_up_scale, down, down_scale, experts.act_fn)
        block.experts = experts
    else:
        experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        experts.down_proj = nn.Parameter(down, requires_grad=False)
        experts.intermediate_dim = local
    if world_size > 1:
        experts.register_forward_hook(functools.partial(_all_reduce_output, group=group))


def _per_expert(tensors: dict, layer: str, proj: str, count: int, required: bool = True) -> list | None:
    found = tensors.get(proj, {})
    if not found and not required:
        return None
    if sorted(found) != list(range(count)):
        missing = next((e for e in range(count) if e not in found), None)
        what = f"no tensor {_name(layer, missing, proj)!r}" if missing is not None else \
            f"{len(found)} experts' {proj}, config.json says {count}"
        raise ArtifactError(f"shard has {what}; the artifact does not match its config.json")
    return [found[e] for e in range(count)]


def _name(layer: str, expert: int, proj: str) -> str:
    base, _, suffix = proj.partition("_")
    return f"{layer}.block_sparse_moe.experts.{expert}.{base}.weight" + (f"_{suffix}" if suffix else "")


def _all_reduce_output(module: nn.Module, args, output: torch.Tensor, *, group=None) -> torch.Tensor:
    """The rank's partial sum over its intermediate slices becomes the whole weighted expert output."""
    if not isinstance(output, torch.Tensor):
        raise InternalError(f"MoE experts returned {type(output).__name__}, expected one tensor")
    dist.all_reduce(output, group=group)
    return output


class QuantizedExperts(nn.Module):
    """Fused experts with int8/fp8 weights at rest: transformers' eager expert loop, one expert dequantized
    per matmul. The per-output-row scale commutes with the matmul, so the matrix is only cast, never rescaled.

    gate_up_proj [experts, 2·local, hidden] with gate_up_scale [experts, 2·local];
    down_proj [experts, hidden, local] with down_scale [experts, hidden].
    """

    def __init__(self, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                 down_scale: torch.Tensor, act_fn):
        super().__init__()
        self.num_experts, _, self.hidden_dim = gate_up.shape
        self.intermediate_dim = down.shape[2]
        self.register_buffer("gate_up_proj", gate_up)
        self.register_buffer("gate_up_scale", gate_up_scale)
        self.register_buffer("down_proj", down)
        self.register_buffer("down_scale", down_scale)
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            if not 0 <= expert < self.num_experts:
                continue  # transformers' sentinel for "no expert"
            token_idx, slot = torch.where(top_k_index == expert)
            x = hidden_states[token_idx]
            gate_up = F.linear(x, self.gate_up_proj[expert].to(dtype)) * self.gate_up_scale[expert].to(dtype)
            gate, up = gate_up.chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[expert].to(dtype)) * self.down_scale[expert].to(dtype)
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(dtype))
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"{self.gate_up_proj.dtype} with scales")
