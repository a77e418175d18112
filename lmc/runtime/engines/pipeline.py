"""Pipeline parallelism across instances: the hf engine cut into stages joined by torch.distributed.

A plan with pipeline degree P runs P stages (one per instance, lmc.runtime.rendezvous), each of TP
ranks: one torch.distributed world of P·TP processes (gloo on CPU, NCCL on GPU), global rank
stage·TP + tp_rank, and one TP group per stage (every process creates every stage's group, in order,
as torch.distributed requires). Stage s loads only its shard (lmc.layouts.stage_shard_path): its
decoder layers, renumbered from 0 — stage 0 also the embedding, the last stage the final norm and the
LM head (or the embedding again, when the head is tied to it).

Generation is the runtime's own decode loop (generate.DecodeLoop) on stage 0, unchanged: to it the
pipeline is a model whose forward runs stage 0's layers, sends the hidden states on, and receives the
last position's logits from the last stage. Each stage keeps its own KV cache per batch: stage 0's is
the loop's DynamicCache; the others make a new one when the loop does, and select the same rows when
the loop drops finished ones (the indices travel with the next step). Point to point, TP rank r of
stage s sends to TP rank r of stage s+1 (each holds the whole hidden state after its all-reduce), and
TP rank r of the last stage returns the logits to TP rank r of stage 0, so TP ranks stay in lockstep.

Each step, stage s → s+1 carries: a header [op, rows, tokens, mask width, new cache, selected rows],
the selected row indices (if any), the hidden states [rows, tokens, hidden], the attention mask and
the position ids. op NOOP (stage 0's idle heartbeat) and STOP (shut down) are passed along alone.
No micro-batching: one batch is in one stage at a time (the other stages wait), which is what a model
larger than one instance needs; it is not a throughput optimisation.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from lmc.errors import ArtifactError, InternalError
from lmc.layouts import PIPELINE_FAMILIES, layer_index, stage_layers, stage_shard_path
from lmc.runtime.engines.hf import HFEngine, _cast, build_skeleton, eos_token_ids, read_shard, resolve_device
from lmc.runtime.rendezvous import PipelineRole, RendezvousError

log = logging.getLogger(__name__)

OP_STEP, OP_NOOP, OP_STOP = 1, 2, 3
_HEADER = 6
_COLLECTIVE_TIMEOUT_S = 600.0


@dataclass
class StageGroups:
    """This process's torch.distributed groups: its stage's TP group (None at TP 1), and a gloo group
    over the same ranks for control messages (the worker loop's broadcasts)."""

    tp_group: Any
    control: Any


def init_stage_groups(role: PipelineRole, local_rank: int, backend: str) -> StageGroups:
    """Join the pipeline's torch.distributed world (the store on the leader, at role.port) and make each
    stage's groups. Raises RendezvousError (one line) when the others do not come within role.timeout_s."""
    rank = role.global_rank(local_rank)
    deadline = time.monotonic() + role.timeout_s
    if rank != 0:
        _wait_for_leader(role, deadline)
    join = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        store = dist.TCPStore(role.leader_address, role.port, role.world_size, is_master=rank == 0, timeout=join,
                              wait_for_workers=True)
    except Exception as exc:  # DistNetworkError, DistStoreError, TimeoutError, a name that does not resolve
        detail = " ".join(str(exc).split())[:300]
        if rank == 0:
            raise RendezvousError(f"{role.describe()}: the other {role.stages - 1} stage(s) did not join within "
                                  f"{role.timeout_s:g} s (LMC_RENDEZVOUS_TIMEOUT_S): {detail}") from None
        raise RendezvousError(f"{role.describe()}: cannot reach the leader's store at {role.leader_address}:{role.port} "
                              f"within {role.timeout_s:g} s (LWS_LEADER_ADDRESS, LMC_RENDEZVOUS_PORT, "
                              f"LMC_RENDEZVOUS_TIMEOUT_S): {detail}") from None
    timeout = datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S)
    store.set_timeout(timeout)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=role.world_size, timeout=timeout)
    groups = None
    for stage in range(role.stages):
        ranks = [stage * role.tp + r for r in range(role.tp)]
        tp_group = dist.new_group(ranks, timeout=timeout) if role.tp > 1 else None
        control = (dist.new_group(ranks, backend="gloo", timeout=timeout) if backend != "gloo" else tp_group) \
            if role.tp > 1 else None
        if stage == role.stage:
            groups = StageGroups(tp_group, control)
    assert groups is not None
    return groups


def _wait_for_leader(role: PipelineRole, deadline: float) -> None:
    """Until the leader's store accepts a connection (its pod may start later, its name may not resolve
    yet), quietly: torch's own store client logs every failed try."""
    last = "no answer"
    while True:
        try:
            socket.create_connection((role.leader_address, role.port), timeout=2.0).close()
            return
        except OSError as exc:
            last = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise RendezvousError(f"{role.describe()}: cannot reach the leader's store at {role.leader_address}:"
                                  f"{role.port} within {role.timeout_s:g} s (LWS_LEADER_ADDRESS, LMC_RENDEZVOUS_PORT, "
                                  f"LMC_RENDEZVOUS_TIMEOUT_S): {last}")
        time.sleep(0.5)


def create_pipeline_engine(plan: dict[str, Any], task: str, role: PipelineRole, groups: StageGroups) -> "PipelineEngine":
    """The engine for this process's stage of `plan` (an lmc.json plan dict), not yet loaded."""
    accelerator = str((plan.get("target") or {}).get("accelerator", "cpu")).lower()
    engine = PipelineEngine(family=plan["model"]["family"], task=task, dtype=plan["dtype"],
                            tensor_parallel_degree=int(plan["tensor_parallel_degree"]),
                            max_sequence_length=int(plan["max_sequence_length"]),
                            batch_size=int(plan["batch_size"]),
                            device="cpu" if accelerator in ("cpu", "local", "") else "cuda")
    engine.attach(role, groups)
    return engine


class PipelineEngine(HFEngine):
    """One TP rank of one pipeline stage. Stage 0 implements the Engine protocol (generate, count_tokens);
    the other stages run `serve_stage()` until stage 0 sends STOP."""

    name = "hf"

    def attach(self, role: PipelineRole, groups: StageGroups) -> None:
        if self.family not in PIPELINE_FAMILIES:
            raise InternalError(f"pipeline engine for family {self.family!r}; the build admits only "
                                f"{', '.join(PIPELINE_FAMILIES)}")
        self.role = role
        self.groups = groups
        self.stage_config = None
        self._pending = None  # stage 0: rows the loop kept since the last step, for the other stages
        self.compact_batches = True

    # -- loading

    def load(self, model_dir: Path, rank: int, world_size: int) -> None:
        import transformers
        from torch import nn

        from lmc.runtime.engines.generate import DecodeLoop
        from lmc.runtime.engines.tp import apply_shard, normalise_names

        model_dir = Path(model_dir)
        role = self.role
        if world_size != self.tp or role.tp != self.tp:
            raise InternalError(f"stage planned for TP {self.tp} started with {world_size} ranks")
        self.rank = rank
        self.device = device = resolve_device(self.device_kind, rank)
        config = transformers.AutoConfig.from_pretrained(model_dir)
        span = stage_layers(config.num_hidden_layers, role.stages)[role.stage]
        stage_config = copy.deepcopy(config)
        stage_config.num_hidden_layers = len(span)
        if isinstance(getattr(config, "layer_types", None), list):
            stage_config.layer_types = config.layer_types[span.start:span.stop]
        state = read_shard(model_dir / stage_shard_path(role.stages, self.tp, role.stage, rank))
        compute_dtype = self._compute_dtype(state)
        state = {_local_name(name, span): _cast(tensor, compute_dtype) for name, tensor in state.items()}
        model = build_skeleton(stage_config, self.task, compute_dtype)
        last = role.stage == role.stages - 1
        if role.stage > 0 and not any("embed_tokens." in name for name in state):
            model.model.embed_tokens = nn.Identity()  # fed hidden states, never token ids
        if not last:
            model.model.norm = nn.Identity()
            model.lm_head = nn.Identity()
        apply_shard(model, normalise_names(state, model, self.family), family=self.family, config=stage_config,
                    rank=rank, world_size=world_size, group=self.groups.tp_group)
        self.model = self._finish(model, compute_dtype, device)
        self.stage_config = self.model.config
        self.compute_dtype = compute_dtype
        self.vocab_size = config.vocab_size
        if role.stage == 0:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
            self.loop = DecodeLoop(_StageZeroModel(self), self.tokenizer, max_sequence_length=self.max_sequence_length,
                                   device=device, eos_token_ids=eos_token_ids(model_dir, config, self.tokenizer),
                                   rank=rank, world_size=world_size, group=self.groups.tp_group,
                                   every_rank_answers=self.every_rank_answers, compact=self.compact_batches)
        log.info("%s, TP rank %d/%d: layers %d-%d of %d loaded (%s) on %s", role.describe(), rank, world_size,
                 span.start, span.stop - 1, config.num_hidden_layers, self.dtype, device)

    # -- point to point

    def _peer(self, stage: int) -> int:
        return self.role.global_rank(self.rank) - self.role.stage * self.role.tp + stage * self.role.tp

    def _send_on(self, header: list[int], *tensors: torch.Tensor) -> None:
        to = self._peer(self.role.stage + 1)
        dist.send(torch.tensor(header, dtype=torch.long, device=self.device), to)
        for tensor in tensors:
            dist.send(tensor.contiguous(), to)

    def _recv(self, shape: tuple[int, ...], dtype, source: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, source)
        return tensor

    # -- stage 0

    def step(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """Stage 0's forward: run its layers, pass the hidden states on, return the last stage's logits
        [rows, 1, vocab] (float32)."""
        new = not getattr(cache, "_lmc_pipeline", False)
        if new:
            self._adopt(cache)
        select, self._pending = self._pending, None
        out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=cache, use_cache=True).last_hidden_state
        rows, tokens = input_ids.shape
        header = [OP_STEP, rows, tokens, attention_mask.shape[1], int(new), 0 if select is None else len(select)]
        extra = () if select is None else (select.to(torch.long),)
        with _fatal_if_broken(self.role):
            self._send_on(header, *extra, out, attention_mask.to(torch.long), position_ids.to(torch.long))
            return self._recv((rows, 1, self.vocab_size), torch.float32, self._peer(self.role.stages - 1))

    def _adopt(self, cache) -> None:
        """A new batch's cache: the other stages start theirs, and the rows the loop keeps (it drops finished
        ones from its cache) are kept there too, at the next step."""
        cache._lmc_pipeline = True
        self._pending = None
        original = cache.batch_select_indices

        def batch_select_indices(indices: torch.Tensor, _original=original) -> None:
            _original(indices)
            self._pending = indices.clone() if self._pending is None else self._pending[indices]

        cache.batch_select_indices = batch_select_indices

    def heartbeat(self) -> None:
        """Stage 0, idle: tell the other stages the pipeline is alive (their receive has a timeout)."""
        with _fatal_if_broken(self.role):
            self._send_on([OP_NOOP, 0, 0, 0, 0, 0])

    def shutdown(self) -> None:
        """Stage 0: the other stages leave serve_stage."""
        self._send_on([OP_STOP, 0, 0, 0, 0, 0])

    # -- the other stages

    def serve_stage(self) -> None:
        """Stages 1 … P-1: receive a step, run the stage's layers, pass it on (the last stage: the logits
        back to stage 0), until STOP."""
        from transformers import DynamicCache

        role = self.role
        last = role.stage == role.stages - 1
        source = self._peer(role.stage - 1)
        hidden_size = self.stage_config.hidden_size
        cache = None
        with torch.inference_mode():
            while True:
                op, rows, tokens, width, new, selected = self._recv((_HEADER,), torch.long, source).tolist()
                if op in (OP_NOOP, OP_STOP):
                    if not last:
                        self._send_on([op, 0, 0, 0, 0, 0])
                    if op == OP_STOP:
                        return
                    continue
                if op != OP_STEP:
                    raise InternalError(f"pipeline stage {role.stage}: unknown message {op}")
                if new:
                    cache = DynamicCache(config=self.stage_config)
                if cache is None:
                    raise InternalError(f"pipeline stage {role.stage}: a step before any batch began")
                select = self._recv((selected,), torch.long, source) if selected else None
                if select is not None:
                    cache.batch_select_indices(select)
                hidden = self._recv((rows, tokens, hidden_size), self.compute_dtype, source)
                mask = self._recv((rows, width), torch.long, source)
                positions = self._recv((rows, tokens), torch.long, source)
                out = self.model.model(inputs_embeds=hidden, attention_mask=mask, position_ids=positions,
                                       past_key_values=cache, use_cache=True).last_hidden_state
                if last:
                    logits = self.model.lm_head(out[:, -1:, :]).float()
                    dist.send(logits.contiguous(), self._peer(0))
                else:
                    header = [OP_STEP, rows, tokens, width, new, selected]
                    self._send_on(header, *(() if select is None else (select,)), out, mask, positions)

    def generate(self, batch, on_token=None, cancel_probe=None):
        if self.role.stage != 0:
            raise InternalError("generate called on a pipeline stage other than 0")
        return super().generate(batch, on_token, cancel_probe)


# Stage 0's exit status when the pipeline broke (another stage died or stopped answering): the front end's
# supervisor fails the batch, answers 503 on /ping and starts the group again, which waits for the
# cluster to bring the other stages back (a torch.distributed world cannot be mended in place).
PIPELINE_BROKEN_EXIT = 69  # EX_UNAVAILABLE


@contextlib.contextmanager
def _fatal_if_broken(role: PipelineRole):
    try:
        yield
    except Exception as exc:  # DistBackendError, a closed connection, a timeout
        log.error("%s: the pipeline broke (%s); exiting so the group restarts", role.describe(),
                  " ".join(str(exc).split())[:300])
        logging.shutdown()
        os._exit(PIPELINE_BROKEN_EXIT)


class _StageZeroModel:
    """What the decode loop sees as the model: a transformers-like forward over the whole pipeline."""

    def __init__(self, engine: PipelineEngine):
        self.engine = engine
        self.config = engine.stage_config

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, position_ids=None,
                logits_to_keep=1):
        if past_key_values is None or attention_mask is None or position_ids is None:
            raise InternalError("the pipeline's stage 0 needs the decode loop's cache, mask and positions")
        return SimpleNamespace(logits=self.engine.step(input_ids, attention_mask, position_ids, past_key_values))

    __call__ = forward


def _local_name(name: str, span: range) -> str:
    """A checkpoint name with its global layer index turned into the stage's own (from 0)."""
    index = layer_index(name)
    if index is None:
        return name
    if index not in span:
        raise ArtifactError(f"shard tensor {name!r} is not one of this stage's layers "
                              f"({span.start}-{span.stop - 1}); the artifact does not match its plan")
    return name.replace(f"layers.{index}.", f"layers.{index - span.start}.", 1)
