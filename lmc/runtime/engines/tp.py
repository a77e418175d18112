"""Module surgery: turn a full-size model skeleton (parameters on the meta device) into one TP rank's model.

The shard file of a rank holds, under the checkpoint's own names, exactly the slice lmc/layouts.py
assigns to that rank. So the local shape of every split Linear is read from the shard itself, and the
layout kind (lmc.layouts.kind_of) only says which collective the module needs:

  column / kv_column   a local Linear, output stays split (the next row-parallel layer consumes it)
  row                  a local Linear, all-reduce of the output, then the (replicated) bias added once
  vocab                a local Linear over part of the vocabulary, logits all-gathered on the last dim
  heads_dim1           T5's relative attention bias keeps the rank's heads only

int8 (weight-only) tensors stay int8 at rest; the per-output-row `<name>_scale` multiplies the output.
Then the attention modules' head counts are patched where the family's forward reads them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lmc.errors import ArtifactError, InternalError
from lmc.layouts import kind_of, rank_split

SCALE_SUFFIX = "_scale"


def leave_process_group(timeout_s: float = 60.0) -> None:
    """Destroy the default process group once every rank has got here (gloo: a monitored barrier first).

    A rank that tore gloo down while its peer was still closing a connection, or that exited with the
    group alive (its threads still joinable at interpreter exit: "terminate called without an active
    exception"), died with a signal now and then on a loaded host. A peer that failed already makes the
    barrier raise: its own exit code says why, so this one goes on and tears down."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            pass
    dist.destroy_process_group()


def exit_rank() -> None:
    """End a rank process whose work is done and whose results are out: leave the process group with the
    other ranks, then exit 0 at once. The interpreter's teardown is skipped: there, after every result
    was out and the group left, rank 0 (the rank holding the group's TCP store) was now and then killed
    by SIGABRT ("terminate called without an active exception" from a C++ thread of torch's): 3 TP 2 test
    runs in one full test run, none in 170 reruns of the same tests under load."""
    leave_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class ShardedLinear(nn.Module):
    """y = x·Wᵀ (·scale) [all-reduce | all-gather] + b, with W possibly int8 at rest.

    `mode`: "local" (no collective), "row" (sum partial outputs over the group, then add the bias once)
    or "gather" (concatenate the ranks' output features: a vocabulary-split LM head).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None, mode: str,
                 world_size: int, group=None):
        super().__init__()
        if mode not in ("local", "row", "gather"):
            raise InternalError(f"unknown ShardedLinear mode {mode!r}")
        self.mode = mode
        self.world_size = world_size
        self.group = group
        self.out_features, self.in_features = weight.shape
        if scale is not None or weight.dtype in (torch.int8, torch.float8_e4m3fn):
            if scale is None:
                raise ArtifactError(f"a {weight.dtype} weight of shape {tuple(weight.shape)} has no '{SCALE_SUFFIX}' "
                                    "tensor beside it in the shard")
            self.register_buffer("weight", weight)
            self.register_buffer("weight_scale", scale.reshape(-1))
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.weight_scale = None
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            # Per-output-row scale commutes with the matmul, so the int8 matrix is only cast, never rescaled.
            y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
        else:
            y = F.linear(x, self.weight)
        if self.mode == "row" and self.world_size > 1:
            dist.all_reduce(y, group=self.group)
        elif self.mode == "gather" and self.world_size > 1:
            parts = [torch.empty_like(y) for _ in range(self.world_size)]
            dist.all_gather(parts, y.contiguous(), group=self.group)
            y = torch.cat(parts, dim=-1)
            if self.bias is not None:  # the bias is split like the rows: gather it too, once
                return y + self._gathered_bias()
            return y
        if self.bias is not None:
            y = y + self.bias
        return y

    def _gathered_bias(self) -> torch.Tensor:
        cached = getattr(self, "_full_bias", None)
        if cached is None:
            parts = [torch.empty_like(self.bias) for _ in range(self.world_size)]
            dist.all_gather(parts, self.bias.data.contiguous(), group=self.group)
            cached = torch.cat(parts)
            self._full_bias = cached
        return cached

    def extra_repr(self) -> str:
        dtype = f"{self.weight.dtype} with scales" if self.weight_scale is not None else str(self.weight.dtype)
        return f"in={self.in_features}, out={self.out_features}, mode={self.mode}, {dtype}"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device but buffers for real.

    Buffers (rotary frequencies, causal masks) are small and computed in __init__; parameters are
    what the shard provides. Same idea as accelerate's init_empty_weights(include_buffers=False).
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


# Where transformers' module names differ from the names checkpoints (and lmc.layouts) use:
# (checkpoint prefix, module prefix).
RENAMES = {"gpt_neox": [("embed_out.", "lm_head.")]}


def normalise_names(state: dict[str, torch.Tensor], model: nn.Module,
                    family: str | None = None) -> dict[str, torch.Tensor]:
    """Map checkpoint names onto the model's: renamed modules, and checkpoints saved without the base prefix."""
    wanted = set(dict(model.named_parameters(remove_duplicate=False))) | set(dict(model.named_buffers()))
    prefix = getattr(model, "base_model_prefix", "")
    out = {}
    for name, tensor in state.items():
        for old, new in RENAMES.get(family or "", []):
            if name.startswith(old):
                name = new + name[len(old):]
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if base not in wanted and prefix and f"{prefix}.{base}" in wanted:
            name = f"{prefix}.{name}"
        out[name] = tensor
    return out


def checkpoint_name(family: str, name: str) -> str:
    """The inverse of the renames: the name lmc.layouts' rules are written for."""
    for old, new in RENAMES.get(family, []):
        if name.startswith(new):
            return old + name[len(new):]
    return name


def apply_shard(model: nn.Module, state: dict[str, torch.Tensor], *, family: str, config, rank: int, world_size: int,
                group=None) -> None:
    """Replace the model's meta parameters with this rank's tensors, doing the module surgery TP needs.

    Raises ArtifactError when the shard lacks a tensor the model needs or holds one it does not know.
    """
    state = dict(state)
    layout_family = _layout_family(family)
    tied = _tied_pairs(model)
    tied_heads = []
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        weight_name = f"{module_name}.weight"
        if weight_name not in state:
            if weight_name in tied:
                tied_heads.append((module_name, tied[weight_name]))
                continue
            raise ArtifactError(f"shard has no tensor {weight_name!r}; the artifact does not match its config.json")
        weight = state.pop(weight_name)
        bias = state.pop(f"{module_name}.bias", None)
        scale = state.pop(weight_name + SCALE_SUFFIX, None)
        kind = kind_of(layout_family, checkpoint_name(family, weight_name)) if layout_family else "replicate"
        mode = {"row": "row", "vocab": "gather"}.get(kind, "local")
        if kind == "vocab" and weight.shape[0] == module.out_features:
            mode = "local"  # the vocabulary does not divide by TP: the head is whole on every rank
        if mode == "local" and scale is None and weight.is_floating_point() and weight.dtype != torch.float8_e4m3fn:
            _fill_linear(module, weight, bias)
        else:
            _replace(model, module_name, ShardedLinear(weight, bias, scale, mode, world_size, group))
    if family == "mixtral":  # MoE: hub expert names into transformers' fused experts (moe.py)
        from lmc.runtime.engines.moe import load_moe_blocks

        load_moe_blocks(model, state, world_size=world_size, group=group)
    _load_rest(model, state)
    for module_name, source_name in tied_heads:
        _tie_head(model, module_name, source_name, layout_family, rank, world_size, group)
    if world_size > 1:
        _patch_head_counts(model, family, config, rank, world_size)
    _check_no_meta(model)


def _layout_family(family: str) -> str | None:
    from lmc.layouts import LAYOUTS

    return family if family in LAYOUTS else None


def _tied_pairs(model: nn.Module) -> dict[str, str]:
    """{LM head weight name: the embedding weight it is tied to}, when the config ties them."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return {}
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(output)]}.weight": f"{names[id(inputs)]}.weight"}


def _tie_head(model, module_name, source_name, family, rank, world_size, group) -> None:
    """A tied LM head is the rank's part of the (replicated) input embedding: a view, no copy."""
    embedding = model.get_parameter(source_name)
    if embedding.device.type == "meta":
        raise ArtifactError(f"shard has neither {module_name + '.weight'!r} nor the embedding {source_name!r} "
                            "it is tied to")
    split = rank_split(family, checkpoint_name(family, f"{module_name}.weight"), tuple(embedding.shape), rank, world_size) if family else None
    head = model.get_submodule(module_name)
    if split is None or split.dim is None:
        head.weight = embedding
        return
    _replace(model, module_name, ShardedLinear(embedding.detach()[split.start:split.stop], head.bias, None, "gather",
                                               world_size, group))


def _fill_linear(module: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Keep the nn.Linear (column-split ones just get narrower): no collective needed."""
    if weight.shape[1] != module.in_features:
        raise ArtifactError(f"a weight of shape {tuple(weight.shape)} does not fit a Linear with "
                            f"{module.in_features} input features")
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.out_features = weight.shape[0]
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)
    elif module.bias is not None and module.bias.device.type == "meta":
        raise ArtifactError(f"shard has no bias for a Linear of shape {tuple(weight.shape)}")


def _replace(model: nn.Module, module_name: str, new: nn.Module) -> None:
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _load_rest(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Everything that is not a Linear: embeddings, norms, T5's relative attention bias, buffers."""
    for name, tensor in state.items():
        module_name, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(module_name) if module_name else model
        except AttributeError:
            module = None
        if module is None or not hasattr(module, attr):
            raise ArtifactError(f"shard tensor {name!r} matches nothing in the model built from config.json")
        if attr in module._buffers:
            module._buffers[attr] = tensor.to(module._buffers[attr].dtype) if module._buffers[attr] is not None else tensor
            continue
        current = getattr(module, attr)
        if isinstance(module, nn.Embedding) and tuple(current.shape) != tuple(tensor.shape) \
                and current.shape[0] == tensor.shape[0]:
            # heads_dim1: T5's [buckets, heads] relative attention bias keeps the rank's heads.
            module.embedding_dim = tensor.shape[1]
        elif tuple(current.shape) != tuple(tensor.shape):
            raise ArtifactError(f"shard tensor {name!r} has shape {tuple(tensor.shape)}, "
                                f"the model expects {tuple(current.shape)}")
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    # Tied embeddings (T5's shared/embed_tokens, tied LM heads already handled) share one tensor.
    _retie(model)


def _retie(model: nn.Module) -> None:
    """Parameters the model declares as the same tensor (T5 encoder/decoder embed_tokens = shared)."""
    shared = getattr(model, "shared", None)
    if isinstance(shared, nn.Embedding):
        for stack in ("encoder", "decoder"):
            sub = getattr(model, stack, None)
            if sub is not None and isinstance(getattr(sub, "embed_tokens", None), nn.Embedding):
                sub.embed_tokens.weight = shared.weight


def _patch_head_counts(model: nn.Module, family: str, config, rank: int, world_size: int) -> None:
    """Attention modules whose forward reads a head count: give them the rank's count."""
    for module in model.modules():
        if family in ("llama", "mistral", "mixtral", "qwen2") and hasattr(module, "num_key_value_groups"):
            q_heads = _out(module.q_proj) // module.head_dim
            kv_heads = _out(module.k_proj) // module.head_dim
            module.num_key_value_groups = q_heads // kv_heads
        elif family == "opt" and hasattr(module, "q_proj") and hasattr(module, "num_heads"):
            module.num_heads = _out(module.q_proj) // module.head_dim
        elif family == "gptj" and hasattr(module, "q_proj") and hasattr(module, "num_attention_heads"):
            module.num_attention_heads = _out(module.q_proj) // module.head_dim
        elif family == "bloom" and hasattr(module, "query_key_value"):
            module.num_heads = _out(module.query_key_value) // (3 * module.head_dim)
            module.pretraining_tp = 1
        elif family == "bloom" and hasattr(module, "dense_4h_to_h"):
            module.pretraining_tp = 1
        elif family == "t5" and hasattr(module, "n_heads") and hasattr(module, "q"):
            module.n_heads = _out(module.q) // module.key_value_proj_dim
            module.inner_dim = _out(module.q)
    if family == "bloom":
        _patch_bloom_alibi(model.transformer, config.n_head, rank, world_size)


def _out(linear: nn.Module) -> int:
    return linear.out_features


def _patch_bloom_alibi(transformer: nn.Module, heads: int, rank: int, world_size: int) -> None:
    """ALiBi slopes depend on the head index: build them for all heads, keep this rank's.

    BloomModel builds ALiBi through `build_alibi_tensor` only when it is given an attention mask
    (without one it computes the slopes inline, for every head), so a call without a mask gets an
    all-ones mask first."""
    original = transformer.build_alibi_tensor
    local = heads // world_size

    def build_alibi_tensor(attention_mask, num_heads, dtype):
        alibi = original(attention_mask, heads, dtype)  # [batch·heads, 1, seq]
        batch = attention_mask.shape[0]
        alibi = alibi.view(batch, heads, 1, -1)[:, rank * local:(rank + 1) * local]
        return alibi.reshape(batch * local, 1, -1)

    def fill_mask(_module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
            if tokens is None:
                tokens = kwargs["inputs_embeds"][..., 0]
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None else 0
            kwargs["attention_mask"] = torch.ones(tokens.shape[0], past + tokens.shape[1], dtype=torch.long,
                                                  device=tokens.device)
        return args, kwargs

    transformer.build_alibi_tensor = build_alibi_tensor
    transformer.register_forward_pre_hook(fill_mask, with_kwargs=True)


def _check_no_meta(model: nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    missing += [n for n, b in model.named_buffers() if b is not None and b.device.type == "meta"]
    if missing:
        raise ArtifactError(f"shard has no tensor {missing[0]!r} ({len(missing)} missing in all); "
                            "the artifact does not match its config.json")

