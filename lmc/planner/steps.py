"""Step times: what one engine iteration costs, for one layout. The serving model (planner/vllm.py) turns
them into TTFT, TPOT and throughput; this module only answers three questions, in milliseconds:

    prefill_ms(tokens)                       a prefill of `tokens` prompt tokens (one sequence)
    decode_ms(batch, context)                a decode step of `batch` sequences at `context` tokens each
    mixed_ms(chunk, batch, prompt, context)  a chunked-prefill step: `chunk` tokens of a `prompt`-token
                                             prompt beside `batch` decodes at `context` tokens, the chunk
                                             priced as if its prompt began there (a later chunk's attention
                                             over the earlier ones: prefix_attention_ms)

Two implementations, chosen in one place (`step_times`):

- `MeasuredSteps`: aiconfigurator-core's per-operation silicon data (GEMMs, attention, all-reduce, MoE,
  measured per GPU and engine version by NVIDIA; Apache-2.0, github.com/ai-dynamo/aiconfigurator), for the
  GPUs, engines and architectures it has data for (a shape its tables lack from the nearest measured one, by
  its HYBRID mode, named in the plan where it answered). Its answers are cached on disk beside lmc's Hub
  summaries ($HF_HOME/lmc/step_times/), per GPU, engine version, model and layout, so a second plan of the
  same deployment never loads its tables.
- `RooflineSteps`: lmc's own model (latency.py: bytes over bandwidth, FLOPs over TFLOPS, collectives over
  the interconnect, corrected by a `lmc calibrate` profile where the target names one) everywhere else:
  GPUs aiconfigurator has no data for (A10G, T4, V100), CPU, Neuron, and lmc's own engines (hf,
  deepspeed, neuronx).

Every plan names the implementation that produced its figures (`predicted.step_times`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lmc.planner.facts import EngineEfficiency, EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.latency import tpot_ms, ttft_ms

# The aiconfigurator-core release lmc reads (pyproject pins it); part of every cache key.
AIC_VERSION = "0.12.0"
# lmc's accelerator names → aiconfigurator's system names, where it has measured data.
AIC_SYSTEMS = {"a100-40gb": "a100_sxm", "a100-80gb": "a100_sxm", "h100-80gb": "h100_sxm", "h200": "h200_sxm",
               "l40s": "l40s", "b200": "b200_sxm"}
# lmc's engines aiconfigurator measured (lmc's vllm engine; SGLang and TensorRT-LLM are not lmc engines).
AIC_BACKENDS = {"vllm": "vllm"}
# Architectures vLLM serves with its Llama decoder layers, which aiconfigurator has no name for: its registry
# (vllm/model_executor/models/registry.py, 0.32) maps them to llama.py's LlamaForCausalLM, or to a subclass of
# it that keeps Llama's attention and gated MLP (mistral.py: Mistral's RoPE scaling only; phi3.py: Phi-3's fused
# checkpoint names only). Their GEMMs and attention are those of aiconfigurator's Llama family, so its data
# answer for them, read as LlamaForCausalLM (aic_config) and named so in the plan (MeasuredSteps.source).
LLAMA_LAYOUT = frozenset({"InternLM3ForCausalLM", "IQuestCoderForCausalLM", "LLaMAForCausalLM", "Ministral3ForCausalLM",
                          "MistralForCausalLM", "Phi3ForCausalLM", "TeleChat3ForCausalLM"})
# Architectures of a dense-first, then MoE decoder with full GQA attention and shared experts that aiconfigurator has
# no name for, and the family of its own with those layers: vLLM's glm4_moe.py (GLM-4.5/4.6/4.7: the first
# `first_k_dense_replace` blocks dense, then routed experts beside shared ones, each block's attention full GQA with
# an optional q/k norm) builds the blocks aiconfigurator's Step-3.5 family builds from a config whose layers all
# attend globally (models/step3p7.py: its hybrid-MoE pipeline with a dense prefix, and the shared experts' GEMMs).
# Written as Step3p5ForCausalLM (aic_config) and named so in the plan.
GLM_MOE_LAYOUT = frozenset({"Glm4MoeForCausalLM"})
# Where aiconfigurator has not measured a shape the model needs (an MoE table is per expert shape, an attention
# table per KV-head count), its HYBRID database mode answers with the utilisation of its nearest measured shape of
# the same kernel and quantization applied to the missing shape's speed-of-light time (transfer kind XSHAPE, its
# "conservative" policy; common.DatabaseMode, TransferKind). Silicon answers are unchanged by it. The plan names
# it where it fired (MeasuredSteps.source).
AIC_DATABASE_MODE, AIC_TRANSFERS = "HYBRID", "conservative"
# vLLM's online fp8 (an unquantized checkpoint, quantized at load) scales each weight tensor whole, so its experts
# split over TP ranks at any width (Triton's fused fp8 MoE masks a partial tile). aiconfigurator steps them on its
# fp8_block table (aic_quant_modes), whose models refuse a rank's expert width that is not a whole number of the
# checkpoint's weight blocks, 128 where its config names none (models/moe.py, hybrid_moe.py:
# _validate_fp8_block_quantized_moe_config). The config lmc hands it for such a checkpoint says its blocks are
# one column wide, which is what per-tensor scales constrain; it changes no answer where the widths are whole
# blocks (tests/test_planner_steps.py), and where they are not the table's nearest shape answers (XSHAPE).
ONLINE_FP8_BLOCKS = {"weight_block_size": [1, 1]}
# aiconfigurator-core 0.12.0's vLLM collector times its block-fp8 GEMMs eagerly and every other GEMM inside a CUDA
# graph (collector/vllm/collect_gemm.py: `use_cuda_graph=gemm_type != "fp8_block"`, one layer per timed call, since
# its commit 4bed48d9 of 2026-05-11, "add RTX PRO 6000 vLLM 0.19.0 data", which gives no reason), so its vLLM
# fp8_block table carries the host's launch of vLLM's linear layer: on an H100 a 1024 x 3072 GEMM of one token is
# 57 µs there, against 7.0 µs for bf16 and per-tensor fp8 in the same table and 8.1 / 7.7 µs in its SGLang and
# TensorRT-LLM fp8_block tables, which time the same per-token-group quantization and DeepGEMM kernel in a graph
# (4.7-6.4x theirs at 1-128 tokens, 1.4x at 1k-8k; bench/fp8_block_gemms.py). vLLM replays its decode steps as
# CUDA graphs, so that launch is not paid; a block-fp8 checkpoint's linear layers are read from the same GPU's
# fp8_block table of the first of these engines that has one (graph_timed_systems), and the plan says so.
GRAPH_TIMED_FP8_BLOCK = ("sglang", "trtllm")
# A transferred answer more than this many times from lmc's own model is not planned on (implausible_transfer), at
# these decode batches (context 1024) and prompt lengths.
TRANSFER_BOUND = 3.0
TRANSFER_PROBE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TRANSFER_PROBE_PROMPTS = (16, 128, 1024, 8192)
# aiconfigurator's model families that leave shared experts out (0.12.0: models/moe.py and models/hybrid_moe.py
# build their MoE blocks with num_shared_experts=0), though vLLM runs them (Llama 4's shared_expert, Qwen2-MoE's):
# lmc adds them from its GEMM data, as its MoE-block builder emits them for DeepSeek (models/blocks/moe.py).
NO_SHARED_EXPERTS = frozenset({"MOE", "HYBRIDMOE"})
# vLLM runs the shared experts on a second CUDA stream beside the routed ones in a step of at most this many tokens,
# one after the other above it (VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD, fused_moe/runner/shared_experts.py).
SHARED_STREAM_TOKENS = 256
# How RooflineSteps.source begins: a plan's figures are lmc's own model's where its step times say so (search.py).
OWN_MODEL = "lmc roofline"
# Set LMC_STEP_TIMES=lmc to plan with lmc's own model everywhere (comparisons, calibration).
FORCE_ENV = "LMC_STEP_TIMES"


class StepTimes(Protocol):
    """One layout's step times (module docstring)."""

    source: str

    def prefill_ms(self, tokens: int) -> float: ...

    def decode_ms(self, batch: int, context: int) -> float: ...

    def mixed_ms(self, chunk: int, batch: int, prompt: int, context: int) -> float: ...

    def server_ms(self, efficiency: EngineEfficiency, prompt: int) -> float:
        """What a request pays outside the engine's steps before its first token (its TTFT only)."""
        ...


def tokenize_ms(efficiency: EngineEfficiency, prompt: int) -> float:
    """Tokenizing the prompt in the server (engines.toml), on either step-time source."""
    return efficiency.tokenize_us_per_token * prompt * 1e-3


def own_server_ms(efficiency: EngineEfficiency, prompt: int) -> float:
    """engines.toml's figures: the server's fixed work per request, and tokenizing the prompt."""
    return efficiency.request_overhead_ms + tokenize_ms(efficiency, prompt)


@dataclass(frozen=True)
class StepLayout:
    """What a step time depends on besides the model and the hardware."""

    engine: str
    dtype: str  # lmc's weight dtype (bf16, fp8, ...)
    kv_dtype: str  # the KV cache's dtype (the compute dtype, or fp8)
    tp: int
    dp: int = 1  # data-parallel attention groups (MoE models: experts spread over tp × dp ranks)
    ep: bool = False  # expert parallelism (MoE): whole experts on each of the tp × dp ranks, not each split tp ways


@dataclass(frozen=True)
class RooflineSteps:
    """lmc's own model (latency.py) as step times."""

    model: ModelFacts
    hardware: HardwareFacts
    engine: EngineFacts
    layout: StepLayout
    why: str = ""  # why measured data does not answer here

    @property
    def source(self) -> str:
        calibrated = " corrected by a lmc calibrate profile" if self.engine.name in self.hardware.measured else ""
        return f"{OWN_MODEL} (latency.py{calibrated})" + (f"; {self.why}" if self.why else "")

    def prefill_ms(self, tokens: int) -> float:
        lay = self.layout
        return ttft_ms(self.model, self.hardware, self.engine, lay.dtype, lay.tp, max(tokens, 1), lay.dp)

    def decode_ms(self, batch: int, context: int) -> float:
        lay = self.layout
        return tpot_ms(self.model, self.hardware, self.engine, lay.dtype, lay.tp, batch, context, 0, lay.dp,
                       kv_dtype=lay.kv_dtype, ep=lay.ep)

    def server_ms(self, efficiency: EngineEfficiency, prompt: int) -> float:
        return own_server_ms(efficiency, prompt)

    def mixed_ms(self, chunk: int, batch: int, prompt: int, context: int) -> float:
        return chunk_beside_decodes_ms(self, chunk, batch, context)


def chunk_beside_decodes_ms(steps: StepTimes, chunk: int, batch: int, context: int) -> float:
    """A mixed step as the decode step plus the chunk's prefill beyond a one-token pass (the weights are read
    once for the whole step): lmc's own model, and one data-parallel group's chunk on measured data."""
    extra = max(steps.prefill_ms(chunk) - steps.prefill_ms(1), 0.0)
    return steps.decode_ms(max(batch, 1), context) + extra


def prefix_attention_ms(steps: StepTimes, position: int, chunk: int) -> float:
    """What `chunk` tokens of a prompt cost beyond the same tokens at the prompt's start, when `position` of its
    tokens are already in the KV cache: their attention over those. A mixed step prices its chunk as a prompt of
    its own (lmc's own model; aiconfigurator's as lmc asks it, MeasuredSteps.mixed_ms), but a chunk's causal
    attention reads every earlier token of its prompt (vLLM's chunked prefill), later chunks more.
    It is the chunk's cost within the whole prompt, prefill(position + chunk) − prefill(position), less its cost
    from the start, prefill(chunk) − prefill(1): the GEMMs, the same at any position, cancel."""
    if position <= 0 or chunk <= 0:
        return 0.0
    within = steps.prefill_ms(position + chunk) - steps.prefill_ms(position)
    return max(within - (steps.prefill_ms(chunk) - steps.prefill_ms(1)), 0.0)


def chunked_prompt_attention_ms(steps: StepTimes, prompt: int, chunk: int) -> float:
    """prefix_attention_ms over a `prompt`-token prompt prefilled `chunk` tokens a step: what its chunks after
    the first cost beyond as many fresh prompts of their size (0 when the prompt fits one step)."""
    total, position = 0.0, max(chunk, 1)
    while position < prompt:
        size = min(chunk, prompt - position)
        total += prefix_attention_ms(steps, position, size)
        position += size
    return total


@dataclass(frozen=True)
class GraphTimed:
    """graph_timed_systems's answer. No folder: aiconfigurator's own answers, with nothing to replace (no
    `refused`) or because the copy could not be made or read (`refused` says why, and the plan repeats it)."""

    folder: str | None = None  # the copy's systems folder
    donor: str = ""  # the table its vLLM fp8_block rows came from ("sglang 0.5.14")
    refused: str = ""


@dataclass
class MeasuredSteps:
    """aiconfigurator-core's step times for one (GPU, engine version, model, layout), cached on disk."""

    system: str
    backend: str
    model_ref: str  # a folder holding the model's config.json
    compile_args: dict
    cache_file: Path | None
    layers: int = 0  # the model's decoder layers (aiconfigurator's per-request dispatch overhead scales with them)
    read_as: str = ""  # "<architecture> read as <aiconfigurator's>" where lmc named the layout for it (LLAMA_LAYOUT)
    shared_ffn: tuple = ()  # the shared experts aiconfigurator's family leaves out (added_shared_experts)
    graph_timed: GraphTimed = GraphTimed()  # where a block-fp8 checkpoint's GEMMs come from (graph_timed_systems)
    qk_norm_ranks: int = 0  # TP ranks of the q/k norm's all-reduce its model leaves out (ModelFacts.qk_norm_allreduce)
    # query key → ms; "error" → why it cannot answer; "transfer" → its transfer tiers for unmeasured shapes
    _answers: dict = field(default_factory=dict)
    _handle: object | None = None
    _loaded: bool = False
    _dirty: bool = False

    @property
    def systems(self) -> str | None:
        """The systems folder aiconfigurator reads: the graph-timed copy, or its own (None)."""
        return self.graph_timed.folder

    @property
    def source(self) -> str:
        data = (f"aiconfigurator-core {AIC_VERSION} measured data ({self.system}, {self.backend} "
                f"{self.compile_args['backend_version']}{'; ' + self.read_as if self.read_as else ''})")
        transfer = self._answers.get("transfer")
        if transfer:  # unavailable() asked which; "" = every probed operation measured
            data += f"; shapes it has not measured from its nearest measured ones ({transfer})"
        return (data + ("; a prompt's prefill: one DP group's, from its per-operation times" if self.groups > 1 else "")
                + ("; the shared experts its model leaves out: from its GEMM data" if self.shared_ffn else "")
                + (f"; block-fp8 GEMMs from its {self.graph_timed.donor} table (its vLLM one is timed without "
                   "CUDA graphs)" if self.graph_timed.donor else "")
                + (f"; block-fp8 GEMMs from its vLLM table, timed without CUDA graphs ({self.graph_timed.refused})"
                   if self.graph_timed.refused else "")
                + ("; the q/k norm's all-reduce its model leaves out: from its all-reduce data" if self.qk_norm_ranks
                   else ""))

    @property
    def transferred(self) -> bool:
        """Whether aiconfigurator answered this layout's probe from shapes it has not measured (unavailable())."""
        return bool(self._answers.get("transfer"))

    @property
    def groups(self) -> int:
        """Data-parallel attention groups (aiconfigurator's attention_dp_size)."""
        return int(self.compile_args.get("attention_dp_size", 1))

    def prefill_ms(self, tokens: int) -> float:
        tokens, groups = max(tokens, 1), self.groups
        if groups > 1:  # one group's prompt, not every group's at once (one_group_prefill_ms)
            step = self._ask(f"p{tokens}/{groups}", lambda h: one_group_prefill_ms(h, tokens, groups))
        else:
            step = self._ask(f"p{tokens}", lambda h: h.predict_prefill_latency(1, tokens))
        return (step + self._shared_extra(tokens, lambda h: routed_moe_ms(one_group_prefill_ops(h, tokens, groups)))
                + self._qk_norm_extra(tokens))

    def decode_ms(self, batch: int, context: int) -> float:
        # aiconfigurator's decode step reads the KV cache at isl + osl // 2 + 1 tokens: osl 1 → context + 1.
        batch, ctx = max(batch, 1), max(context - 1, 1)
        step = self._ask(f"d{batch},{ctx}", lambda h: h.decode_step_latency(batch, ctx, 1))
        def routed(handle) -> float:
            return routed_moe_ms(handle.decode_step_per_op(batch, ctx, 1))

        return step + self._shared_extra(batch, routed, f"d{batch},{ctx}") + self._qk_norm_extra(batch)

    def _qk_norm_extra(self, tokens: int) -> float:
        """The all-reduce of a step's q and k variances in every block where the model's q/k norm spans all heads
        (ModelFacts.qk_norm_allreduce), from its custom all-reduce data (qk_norm_allreduce_ms)."""
        if not self.qk_norm_ranks:
            return 0.0
        return self._ask(f"q{tokens}", lambda h: qk_norm_allreduce_ms(h, self.layers, self.qk_norm_ranks, tokens))

    def _shared_extra(self, tokens: int, routed, at: str = "") -> float:
        """What the shared experts aiconfigurator's family leaves out add to a step of `tokens` tokens: their
        GEMMs from its data, all of them above SHARED_STREAM_TOKENS (after the routed experts), and below it what
        they take beyond the routed experts' block (`routed(handle)`, ms) beside which they run on their own
        stream (its convention for two streams, OverlapOp: the longer of the two)."""
        if not self.shared_ffn:
            return 0.0
        shared = self._ask(f"s{tokens}", lambda h: shared_experts_ms(h, self.shared_ffn, tokens))
        if tokens > SHARED_STREAM_TOKENS:
            return shared
        return max(shared - self._ask(f"r{at or tokens}", routed), 0.0)

    def server_ms(self, efficiency: EngineEfficiency, prompt: int) -> float:
        """aiconfigurator's own per-request overhead for its engine instead of engines.toml's fixed term (its
        kernel data leave out the CPU's dispatch and the server, which its vLLM backend adds to every TTFT,
        calibrated against its measured serving runs: `_prefill_dispatch_overhead_ms`), and tokenizing."""
        return _dispatch_overhead_ms(self.backend, self.layers) + tokenize_ms(efficiency, prompt)

    def mixed_ms(self, chunk: int, batch: int, prompt: int, context: int) -> float:
        if batch <= 0:
            return self.prefill_ms(chunk)
        if self.groups > 1:  # its mixed step is a chunk in every group: one group's, as lmc's own model adds it
            return chunk_beside_decodes_ms(self, chunk, batch, context)
        # Its mixed step: the chunk of an `isl`-token prompt beside decodes at isl + osl/2 tokens. A chunk of a
        # longer prompt is asked as a prompt of its own (isl = chunk): its step spreads a prompt's attention
        # over earlier chunks evenly over the chunks, which the serving model adds where it falls instead
        # (prefix_attention_ms); a chunk of shorter prompts is that many prompts (isl = prompt).
        chunk = max(chunk, 1)
        isl = min(max(prompt, 1), chunk)
        osl = max(2 * (context - isl), 2)
        key = f"m{chunk},{batch},{isl},{osl}"
        step = self._ask(key, lambda h: h.mixed_step_latency(chunk, batch, isl, osl))
        return step + self._shared_extra(
            chunk + batch, lambda h: routed_moe_ms(h.mixed_step_breakdown_per_op(chunk, batch, isl, osl)[0]),
            key) + self._qk_norm_extra(chunk + batch)

    def unavailable(self) -> str | None:
        """Why aiconfigurator cannot model this layout (it raised on a one-sequence decode step), remembered
        in the cache like its answers; None when it can."""
        try:
            self.decode_ms(1, 2)
            self._probe_transfer()
        except Exception as exc:  # its own errors: unsupported quantization, missing tables, ...
            # Its measured tables' own error names what is missing; the transfer's only that it found no neighbour.
            exc = self._silicon_error() or exc
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            # Its messages name files on this machine, and list what it tried: the plan keeps what is missing.
            first = re.sub(r" at /[^\s;]+", "", first).split("; available")[0].split(": tried lane_order")[0]
            self._answers["error"] = first[:200]
            _write_cache(self.cache_file, self._answers)
        error = self._answers.get("error")
        return None if error is None else f"aiconfigurator could not model this layout: {error}"

    def _silicon_error(self) -> Exception | None:
        """The error of aiconfigurator's measured data alone (its SILICON mode) for a one-sequence decode step."""
        try:
            silicon = _compile(self.model_ref, self.system, self.backend, self.compile_args, "SILICON", self.systems)
            silicon.decode_step_latency(1, 1, 1)
        except Exception as exc:
            return exc
        return None

    def _probe_transfer(self) -> None:
        """Whether aiconfigurator answers this layout from shapes it has not measured (AIC_DATABASE_MODE): the
        transfer tiers its engine reports (`last_provenance`) for a decode step and a prefill, remembered in the
        cache with the answers, so that the plan names them the same way whether its figures were cached or not."""
        if "transfer" in self._answers:
            return
        handle = self.handle()
        tiers = set()
        for query in (lambda: handle.decode_step_latency(1, 1, 1), lambda: handle.predict_prefill_latency(1, 16)):
            query()
            tiers.add(handle.last_provenance() or "")
        self._answers["transfer"] = ", ".join(sorted(tiers - {""}))
        self._dirty = True

    def _ask(self, key: str, query) -> float:
        if not self._loaded:
            self._answers.update(_read_cache(self.cache_file))
            self._loaded = True
        if "error" in self._answers:
            raise RuntimeError(self._answers["error"])
        if key not in self._answers:
            self._answers[key] = float(query(self.handle()))
            self._dirty = True
        return self._answers[key]

    def save(self) -> None:
        """Write this layout's answers to the disk cache if any are new."""
        if self._dirty:
            _write_cache(self.cache_file, self._answers)
            self._dirty = False

    def handle(self):
        if self._handle is None:
            self._handle = _compile(self.model_ref, self.system, self.backend, self.compile_args, systems=self.systems)
        return self._handle


def moe_op(name: str) -> bool:
    """An operation of aiconfigurator's routed-expert block: the experts, their dispatch and combine
    (`context_moe*`, `generation_moe*`, Llama 4's `context_global_moe*`, ...), not the norm before it."""
    return "_moe" in name and not name.endswith("_norm")


def one_group_prefill_ms(handle, tokens: int, groups: int) -> float:
    """One data-parallel group's prefill of `tokens`, from aiconfigurator's data.

    With attention_dp_size > 1 its prefill of `tokens` is every group prefilling that many at once: its MoE
    blocks (the experts, and the dispatch and combine over every rank) carry groups × tokens. A prompt joins
    one group, and the other groups go on decoding: its own operations (attention, the dense GEMMs, norms,
    the router and shared experts) run at `tokens` on its ranks, while its tokens spread over the experts of
    every rank, i.e. the MoE blocks carry the load of `tokens / groups` from each group. So: the prefill's
    per-operation times at `tokens`, with the MoE blocks' taken from the prefill at tokens / groups."""
    return sum(op[1] for op in one_group_prefill_ops(handle, tokens, groups))


def one_group_prefill_ops(handle, tokens: int, groups: int) -> list:
    """The per-operation times of one_group_prefill_ms: its own operations at `tokens`, the MoE blocks' at
    tokens / groups."""
    own, _ = handle.run_static_per_op(batch_size=1, isl=tokens, osl=2)
    if groups == 1:
        return own
    spread, _ = handle.run_static_per_op(batch_size=1, isl=-(-tokens // groups), osl=2)
    return [op for op in own if not moe_op(op[0])] + [op for op in spread if moe_op(op[0])]


def routed_moe_ms(per_op: list) -> float:
    """The routed experts' block in aiconfigurator's per-operation times of one step: the router, the dispatch,
    the experts and the combine (its `*_router_gemm` and `*_moe*` operations, less the norms)."""
    return sum(op[1] for op in per_op if op[0].endswith("router_gemm") or moe_op(op[0]))


def shared_experts_ms(handle, shared_ffn: tuple, tokens: int) -> float:
    """The shared experts of `tokens` tokens in every MoE block, from aiconfigurator's GEMM data: the operations
    its MoE-block builder emits for them (a fused gate and up GEMM, the gated activation, the down GEMM), at one
    rank's width and share of the tokens (added_shared_experts), evaluated by its engine (`evaluate_ops_json`)."""
    import aiconfigurator_core.sdk.operations as ops
    from aiconfigurator_core.sdk import common
    from aiconfigurator_core.sdk.engine import build_ops_json

    blocks, hidden, width, quant, token_ranks = shared_ffn
    mode, tokens = common.GEMMQuantMode[quant], -(-tokens // token_ranks)
    block = [ops.GEMM("generation_shared_gate_up_gemm", blocks, 2 * width, hidden, mode),
             ops.ElementWise("generation_shared_act_gate", blocks, 2 * width, width, 0.8),
             ops.GEMM("generation_shared_ffn2_gemm", blocks, hidden, width, mode)]
    answer = handle.evaluate_ops_json(build_ops_json(block), is_context=False, batch_size=tokens, s=1, x=tokens)
    return sum(op[1] for op in answer)


# aiconfigurator's custom all-reduce tables start at 128 elements (vLLM's graph-timed one: 4.7 µs at 8 H100s);
# a smaller message costs what that one does, the kernel's floor, where its lookup would scale down to nothing.
ALLREDUCE_MIN_ELEMENTS = 128


def qk_norm_allreduce_ms(handle, layers: int, ranks: int, tokens: int) -> float:
    """vLLM's all-reduce of a step's q and k variances in each of `layers` blocks (two fp32 numbers a token, as
    four 16-bit elements), on aiconfigurator's custom all-reduce data for `ranks` ranks (`evaluate_ops_json`)."""
    import aiconfigurator_core.sdk.operations as ops
    from aiconfigurator_core.sdk.engine import build_ops_json

    width = max(4, -(-ALLREDUCE_MIN_ELEMENTS // max(tokens, 1)))  # elements a token, the message at its floor
    op = [ops.CustomAllReduce("generation_qk_norm_ar", layers, width, ranks)]
    answer = handle.evaluate_ops_json(build_ops_json(op), is_context=False, batch_size=tokens, s=1, x=tokens)
    return sum(entry[1] for entry in answer)


def step_times(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, layout: StepLayout, *,
               fits: bool = True) -> StepTimes:
    """The step-time source for this (hardware, engine, model): aiconfigurator's measured data where it has
    them, lmc's own model elsewhere (and why, in its `source`). The one place the choice is made. `fits`
    False: a layout the memory rejects, ranked among the rejected by lmc's own model (measured data are
    looked up only for layouts a plan can choose)."""
    why = measured_unavailable(model, hardware, engine) if fits else "does not fit"
    if why is None:
        measured = _measured(model, hardware, engine, layout)
        why = measured if isinstance(measured, str) else measured.unavailable()
        if why is None and measured.transferred:
            why = implausible_transfer(measured, RooflineSteps(model, hardware, engine, layout))
        if why is None:
            return measured
    return RooflineSteps(model, hardware, engine, layout, why)


def implausible_transfer(measured: MeasuredSteps, own: RooflineSteps) -> str | None:
    """Why a layout aiconfigurator answers by transfer (unmeasured shapes from the nearest measured ones) is not
    planned on it: a step it puts more than TRANSFER_BOUND times from lmc's own model, over a grid of decode
    batches and prompt lengths. Its transfers are usually within 0.5-1.8x of the measurement they stand in for
    (bench/xshape_holdout.py), and lmc's own model within 0.37-2.3x of measured data (bench/own_model_vs_data.py),
    but a transfer can be absurd where the nearest shape was measured at other token counts (A100, Qwen3-235B-A22B's
    experts held out: a one-token decode step 132x the measured one)."""
    probes = [(f"a decode step of {batch} at 1024 tokens", lambda s, b=batch: s.decode_ms(b, 1024))
              for batch in TRANSFER_PROBE_BATCHES]
    probes += [(f"a prefill of {tokens} tokens", lambda s, n=tokens: s.prefill_ms(n))
               for tokens in TRANSFER_PROBE_PROMPTS]
    for what, ask in probes:
        theirs, ours = ask(measured), ask(own)
        if not 1 / TRANSFER_BOUND <= theirs / ours <= TRANSFER_BOUND:
            return (f"aiconfigurator's transfer from its nearest measured shapes put {what} at {theirs:.1f} ms, "
                    f"{theirs / ours:.1f}x lmc's own model ({ours:.1f} ms): not used")
    return None


def measured_unavailable(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts) -> str | None:
    """Why aiconfigurator's data cannot answer for this target (None when it can)."""
    if os.environ.get(FORCE_ENV) == "lmc":
        return f"{FORCE_ENV}=lmc"
    if engine.name not in AIC_BACKENDS:
        return f"aiconfigurator has no data for lmc's {engine.name} engine"
    if hardware.kind != "gpu" or hardware.accelerator not in AIC_SYSTEMS:
        return f"aiconfigurator has no data for {hardware.accelerator}"
    if engine.name in hardware.measured:
        return f"the target's lmc calibrate profile measured {engine.name} on this machine"
    if _aic_architectures() is None:
        return "aiconfigurator-core is not installed"
    if _aic_family(model.architecture) is None and _bundled_config(model.id) is None:
        return f"aiconfigurator has no model of {model.architecture}"
    return None


# --- aiconfigurator: model, layout and quantization -------------------------------------------------

def _measured(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts,
              layout: StepLayout) -> MeasuredSteps | str:
    system, backend = AIC_SYSTEMS[hardware.accelerator], AIC_BACKENDS[engine.name]
    bundled = _bundled_config(model.id)
    config = bundled if bundled is not None else aic_config(model)
    if config is None:
        return _config_refusal(model) or f"aiconfigurator has no model of {model.architecture}"
    if model.checkpoint_quantization is None:
        config = {**config, "quantization_config": ONLINE_FP8_BLOCKS}
    quant = aic_quant_modes(model, hardware, layout, bundled is not None)
    if isinstance(quant, str):
        return quant
    args = {"tp_size": layout.tp, "attention_dp_size": layout.dp, "backend_version": _backend_version(system, backend),
            **quant}
    if model.num_experts > 1:  # vLLM: experts split over the TP ranks, or whole over tp × dp with expert parallelism
        args.update({"moe_tp_size": 1, "moe_ep_size": layout.tp * layout.dp} if layout.ep or layout.dp > 1
                    else {"moe_tp_size": layout.tp, "moe_ep_size": 1})
    shared = added_shared_experts(model, layout, args)
    timed = graph_timed_systems(system) if block_fp8_gemms(config, args) and backend == "vllm" else GraphTimed()
    qk_norm_ranks = layout.tp if model.qk_norm_allreduce and layout.tp > 1 else 0
    key = json.dumps({"aic": AIC_VERSION, "system": system, "backend": backend, "config": config, "args": args,
                      "database": [AIC_DATABASE_MODE, AIC_TRANSFERS],
                      **({"shared_ffn": list(shared)} if shared else {}),
                      **({"fp8_block_gemms": timed.donor} if timed.folder else {}),
                      **({"qk_norm_ranks": qk_norm_ranks} if qk_norm_ranks else {})}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    folder = _cache_root()
    # Always a folder of lmc's own: aiconfigurator reads any other model path from the Hub.
    try:
        ref = str(_config_folder(folder, config))
    except OSError as exc:
        return f"no writable folder for the model's config under HF_HOME ({exc.strerror})"
    read_as = config["architectures"][0] if bundled is None else model.architecture
    named = "" if read_as == model.architecture else f"{model.architecture} read as {read_as}"
    # One per layout and name per process: its answers and compiled engine are reused (the disk cache is per
    # layout: the same shapes under another name have the same step times).
    if (digest, named) not in _MEASURED:
        cache_file = folder / f"{system}--{backend}" / f"{digest}.json"
        _MEASURED[digest, named] = MeasuredSteps(system, backend, ref, args, cache_file, model.layers, named, shared,
                                                 timed, qk_norm_ranks)
    return _MEASURED[digest, named]


_MEASURED: dict[tuple[str, str], MeasuredSteps] = {}


def save_step_times() -> None:
    """Write the measured step times this process looked up to the disk cache ($HF_HOME/lmc/step_times): the
    CLI's edge calls it after planning (pipeline.plan_from_spec), and it runs at exit for other callers."""
    for measured in _MEASURED.values():
        measured.save()


atexit.register(save_step_times)


# A quantized checkpoint whose config aiconfigurator does not bundle, by how lmc's facts name its weights:
# what vLLM runs it with on a GPU that has the kernels (fp8: w8a8 fp8 GEMMs on Hopper/Ada/Blackwell; 4-bit
# AWQ/GPTQ: weight-only int4 GEMMs with 16-bit activations; MXFP4 experts: weight-only, 16-bit activations).
CHECKPOINT_MODES = {
    "fp8": {"gemm_quant_mode": "fp8", "moe_quant_mode": "fp8"},
    "int4": {"gemm_quant_mode": "int4_wo", "moe_quant_mode": "int4_wo"},
    "mxfp4": {"gemm_quant_mode": "bfloat16", "moe_quant_mode": "w4a16_mxfp4"},
}


def aic_quant_modes(model: ModelFacts, hardware: HardwareFacts, layout: StepLayout,
                    bundled: bool) -> dict | str:
    """aiconfigurator's quantization modes for lmc's dtype: fp8 is vLLM's online fp8 (fp8 weights, dynamic
    fp8 activations where the GPU computes in fp8); a quantized checkpoint keeps its own (aiconfigurator
    reads it from the bundled config, else from CHECKPOINT_MODES); an fp8 KV cache is its fp8 KV mode."""
    modes: dict[str, str] = {}
    if layout.kv_dtype == "fp8":
        modes["kvcache_quant_mode"] = "fp8"
    quantized = model.checkpoint_quantization
    if quantized is not None:
        if bundled:
            return modes
        if quantized not in CHECKPOINT_MODES or (quantized == "fp8" and "fp8" not in hardware.dtypes):
            return f"aiconfigurator has no data for vLLM's kernels of a {quantized} checkpoint on {hardware.accelerator}"
        return {**modes, **CHECKPOINT_MODES[quantized]}
    if layout.dtype == "fp8":
        if "fp8" not in hardware.dtypes:
            return f"aiconfigurator has no weight-only fp8 kernels for {hardware.accelerator}"
        # The experts: vLLM's online fp8 quantizes activations dynamically, which FlashInfer's CUTLASS experts
        # (static scales only: aiconfigurator's "fp8" table, ModelOpt checkpoints) do not take and vLLM's own
        # CUTLASS path is off by default (fused_moe/oracle/fp8.py), so it runs Triton's fused fp8 MoE: the
        # kernel of aiconfigurator's "fp8_block" table.
        modes.update(gemm_quant_mode="fp8", moe_quant_mode="fp8_block")
    elif layout.dtype in ("bf16", "fp16"):
        modes.update(gemm_quant_mode="bfloat16", moe_quant_mode="bfloat16")
    else:
        return f"aiconfigurator has no {layout.dtype} data for vLLM"
    return modes


def aic_config(model: ModelFacts) -> dict | None:
    """A config.json aiconfigurator reads, from lmc's facts (dense and MoE decoders of the Llama and Qwen
    layouts: the architectures whose every figure the facts hold). An architecture of Llama's layout that
    aiconfigurator does not name (LLAMA_LAYOUT) is written as LlamaForCausalLM, one of GLM-4's MoE layout
    (GLM_MOE_LAYOUT) as Step3p5ForCausalLM with every layer attending globally."""
    if _config_refusal(model) is not None:
        return None
    named = model.architecture in (_aic_architectures() or {})
    glm = model.architecture in GLM_MOE_LAYOUT
    config = {
        "architectures": [model.architecture if named else "Step3p5ForCausalLM" if glm else "LlamaForCausalLM"],
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.layers, "num_attention_heads": model.attention_heads,
        "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim,
        "intermediate_size": model.intermediate_size, "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings or 131072,
        "tie_word_embeddings": model.tie_word_embeddings,
        "torch_dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(model.torch_dtype, "bfloat16"),
    }
    if model.num_experts > 1:
        config.update(num_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
                      moe_intermediate_size=model.intermediate_size)
    if glm:  # its dense blocks first, then the MoE ones, each with the shared experts (models/step3p7.py)
        config.update(layer_types=["full_attention"] * model.layers, share_expert_dim=model.shared_expert_width,
                      first_k_dense_replace=model.layers - (model.moe_layers or model.layers),
                      intermediate_size=model.dense_intermediate_size or model.intermediate_size)
    return config


def added_shared_experts(model: ModelFacts, layout: StepLayout, args: dict) -> tuple:
    """(MoE blocks, hidden size, the shared experts' width per rank, GEMM quantization, the ranks a step's tokens
    are split over) where aiconfigurator's family of the model leaves its shared experts out (NO_SHARED_EXPERTS);
    () elsewhere. vLLM splits them over the TP ranks of the attention, except with data-parallel groups of
    more than one rank and expert parallelism, where its MoE is sequence parallel (ParallelConfig
    .use_sequence_parallel_moe, with the default all2all backend): each rank runs them whole on its share of
    the tokens (llama4.py: `disable_tp=self.is_sequence_parallel`)."""
    if _aic_family(model.architecture) not in NO_SHARED_EXPERTS or not model.shared_expert_width:
        return ()
    quant = args.get("gemm_quant_mode") or CHECKPOINT_MODES.get(model.checkpoint_quantization or "", {}).get(
        "gemm_quant_mode", "bfloat16")
    blocks, width = model.moe_layers or model.layers, model.shared_expert_width
    if layout.dp > 1 and layout.tp > 1:
        return (blocks, model.hidden_size, width, quant, layout.tp)
    return (blocks, model.hidden_size, width // layout.tp, quant, 1)


def _config_refusal(model: ModelFacts) -> str | None:
    """Why aic_config writes no config.json for this model (None when it does): a family other than its Llama
    and MoE decoders, or layers they have not."""
    family = _aic_family(model.architecture)
    glm = model.architecture in GLM_MOE_LAYOUT and model.num_experts > 1
    if (family not in ("LLAMA", "MOE") or (model.num_experts > 1 and family != "MOE")) and not glm:
        return f"aiconfigurator has no model of {model.architecture}"
    if model.kv_lora_rank:
        return f"aiconfigurator's model of {model.architecture} has no latent (MLA) attention"
    if model.sliding_window_layers:
        return f"aiconfigurator's model of {model.architecture} has no sliding-window layers"
    return None


def block_fp8_gemms(config: dict, args: dict) -> bool:
    """Whether aiconfigurator reads the layout's linear layers from its fp8_block GEMM table: a checkpoint
    quantized in fp8 blocks (its config's `weight_block_size` beside quant_method fp8, or compressed-tensors'
    "block" strategy: aiconfigurator's own reading, sdk/utils.py), with no GEMM mode of lmc's."""
    if "gemm_quant_mode" in args:
        return False
    quant = config.get("quantization_config") or {}
    blocks = quant.get("weight_block_size") or []
    if quant.get("quant_method") == "fp8" and len(blocks) == 2 and min(blocks) > 1:
        return True
    groups = quant.get("config_groups") or {}
    return any(isinstance(group, dict) and (group.get("weights") or {}).get("strategy") == "block"
               and (group.get("weights") or {}).get("type") == "float" for group in groups.values())


def graph_timed_systems(system: str) -> GraphTimed:
    """A copy of aiconfigurator's systems folder (its yaml files and `system`'s data) whose vLLM GEMM tables take
    their fp8_block rows from the newest table of the first engine in GRAPH_TIMED_FP8_BLOCK that has them for the
    same GPU, with that table's name. Made once under $HF_HOME/lmc/aic_systems, by a child process: rewriting the
    tables takes pandas, which `lmc plan` never imports."""
    return _graph_timed_systems(system, _cache_root().parent / "aic_systems" / AIC_VERSION / system / "systems")


@functools.cache
def _graph_timed_systems(system: str, target: Path) -> GraphTimed:
    marker = target / GRAPH_TIMED_MARKER
    if not marker.is_file():
        import subprocess
        import sys

        code = "import sys; from lmc.planner.steps import build_graph_timed; build_graph_timed(*sys.argv[1:])"
        try:
            subprocess.run([sys.executable, "-c", code, system, str(target)], check=True, capture_output=True,
                           text=True, timeout=300)
        except subprocess.CalledProcessError as exc:
            last = (exc.stderr or "").strip().splitlines()
            return GraphTimed(refused=f"its graph-timed copy could not be made under {target.parent}: "
                                      f"{last[-1] if last else exc}")
        except (OSError, subprocess.SubprocessError) as exc:
            return GraphTimed(refused=f"its graph-timed copy could not be made under {target.parent}: {exc}")
    try:
        donor = json.loads(marker.read_text()).get("fp8_block_gemms") or ""
    except (OSError, ValueError) as exc:
        return GraphTimed(refused=f"its graph-timed copy's marker is unreadable: {exc}")
    return GraphTimed(str(target), donor) if donor else GraphTimed()


GRAPH_TIMED_MARKER = "lmc-graph-timed.json"  # in graph_timed_systems's folder: where its fp8_block rows came from


def build_graph_timed(system: str, target: str) -> None:
    """Write graph_timed_systems's folder at `target`, atomically (a folder beside it, renamed), with its marker;
    a marker alone (no donor) where aiconfigurator has no vLLM fp8_block table or no other engine's for `system`."""
    import shutil

    import pandas as pd

    source, final = aic_systems_folder(), Path(target)
    gemm = source / "data" / system / "gemm"

    def block_rows(table: Path):
        frame = pd.read_parquet(table) if table.is_file() else None
        return None if frame is None or not (frame.gemm_dtype == "fp8_block").any() else frame

    donor = next(((f"{engine} {version}", rows) for engine in GRAPH_TIMED_FP8_BLOCK
                  for version in _versions_newest_first(gemm / engine)
                  if (rows := block_rows(gemm / engine / version / "gemm_perf.parquet")) is not None), None)
    eager = {table: frame for table in (gemm / "vllm").glob("*/gemm_perf.parquet")
             if (frame := block_rows(table)) is not None}
    staging = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if donor is not None and eager:
            copy_systems(system, staging)
            rows = donor[1][donor[1].gemm_dtype == "fp8_block"]
            for table, frame in eager.items():
                rows = rows.assign(framework=frame.framework.iloc[0], version=frame.version.iloc[0])
                pd.concat([frame[frame.gemm_dtype != "fp8_block"], rows], ignore_index=True).to_parquet(
                    staging / table.relative_to(source))
        label = donor[0] if donor is not None and eager else ""
        (staging / GRAPH_TIMED_MARKER).write_text(json.dumps({"fp8_block_gemms": label}))
        try:
            staging.replace(final)
        except OSError:  # another process made it first
            if not (final / GRAPH_TIMED_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def aic_systems_folder() -> Path:
    """The installed aiconfigurator-core's systems folder: its GPUs' yaml files and their measured data."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    assert spec is not None and spec.origin is not None  # measured_unavailable checked
    return Path(spec.origin).parent / "systems"


def copy_systems(system: str, destination: Path) -> None:
    """A systems folder aiconfigurator reads `system` from, at `destination`: its yaml files and that GPU's data
    (graph_timed_systems; bench/xshape_holdout.py's held-out copies)."""
    import shutil

    source = aic_systems_folder()
    destination.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file():
            shutil.copy(path, destination / path.name)
    shutil.copytree(source / "data" / system, destination / "data" / system)


def _versions_newest_first(folder: Path) -> list[str]:
    from packaging.version import InvalidVersion, Version

    def order(name: str):
        try:
            return (1, Version(name))
        except InvalidVersion:
            return (0, Version("0"))

    names = [path.name for path in folder.iterdir() if path.is_dir()] if folder.is_dir() else []
    return sorted(names, key=order, reverse=True)


@functools.cache
def _backend_version(system: str, backend: str) -> str:
    """The engine version whose data aiconfigurator answers with by default for `system` (its 'current'
    slot, systems/query_versions.yaml): part of the cache key and of the figures' name."""
    import yaml

    slots = yaml.safe_load((aic_systems_folder() / "query_versions.yaml").read_text())
    chosen = (slots.get("overrides") or {}).get(system, {}).get(backend) or slots["defaults"][backend]
    return str(chosen["current"])


def _aic_family(architecture: str) -> str | None:
    """aiconfigurator's model family for an architecture: its own name for it, else LLAMA for an architecture
    vLLM runs as Llama (LLAMA_LAYOUT), STEP3P7 for GLM-4's MoE layout (GLM_MOE_LAYOUT); None where it has
    neither (or is not installed)."""
    archs = _aic_architectures()
    if archs is None:
        return None
    return archs.get(architecture) or ("LLAMA" if architecture in LLAMA_LAYOUT else
                                       "STEP3P7" if architecture in GLM_MOE_LAYOUT else None)


def _aic_architectures() -> dict[str, str] | None:
    if importlib.util.find_spec("aiconfigurator_core") is None:
        return None
    from aiconfigurator_core.sdk.common import ARCHITECTURE_TO_MODEL_FAMILY

    return ARCHITECTURE_TO_MODEL_FAMILY


@functools.cache
def _bundled_config_text(model_id: str) -> str | None:
    """The published config.json aiconfigurator ships for `model_id` (case-insensitive), if any."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "model_configs"
    wanted = model_id.replace("/", "--").lower() + "_config.json"
    for path in folder.glob("*_config.json"):
        if path.name.lower() == wanted and not path.name.endswith("hf_quant_config.json"):
            return path.read_text()
    return None


def _bundled_config(model_id: str) -> dict | None:
    text = _bundled_config_text(model_id)
    return None if text is None else json.loads(text)


# aiconfigurator-core 0.12.0's vLLM backend (VLLMBackend._prefill_dispatch_overhead_ms): 0.8 ms of CPU dispatch
# per decoder layer on every TTFT, calibrated against its measured serving runs. Written out here because
# importing its backends loads numpy and pandas, which `lmc plan` never does; tests/test_planner_steps.py
# compares it with aiconfigurator's own method.
AIC_DISPATCH_MS_PER_LAYER = {"vllm": 0.8}


def _dispatch_overhead_ms(backend: str, layers: int) -> float:
    """aiconfigurator's per-request overhead of `backend` for a model of `layers` decoder layers."""
    return AIC_DISPATCH_MS_PER_LAYER[backend] * layers


def _compile(model_ref: str, system: str, backend: str, args: dict, mode: str = AIC_DATABASE_MODE,
             systems: str | None = None):
    """aiconfigurator's engine for one model and layout, on its database in `mode`: its own
    `compile_engine` (sdk/engine.py) with the database view that mode names, which that function does not take
    (it loads the default, SILICON). `systems`: a copy of its systems folder to read instead of its own
    (bench/xshape_holdout.py)."""
    import logging

    import aiconfigurator_core
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.config_builders import apply_nextn, build_model_config
    from aiconfigurator_core.sdk.engine import EngineHandle, build_engine_spec_json
    from aiconfigurator_core.sdk.models import get_model

    # Its table loader logs a warning per low-fidelity fallback table: not lmc's user's concern.
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    args = dict(args)
    version = args.pop("backend_version")
    config = build_model_config(pp_size=1, **{"moe_tp_size": 1, "moe_ep_size": 1, **args})
    apply_nextn(config, 0)
    model = get_model(model_ref, config, backend)
    database = perf_database.get_database_view(system, backend, version, systems_paths=systems, database_mode=mode,
                                               transfer_policy=AIC_TRANSFERS)
    spec = build_engine_spec_json(model, model_path=model_ref, system=system, backend=backend, backend_version=version,
                                  kv_block_size=None, systems_path=systems, nextn=config.nextn, database=database)
    return EngineHandle(aiconfigurator_core.engine_spec_bincode_from_json(spec), systems_path=systems)


# --- the disk cache ---------------------------------------------------------------------------------

def _cache_root() -> Path:
    """Beside lmc's Hub summaries (lmc/hub.py): $HF_HOME/lmc/step_times."""
    try:
        from huggingface_hub import constants
    except ImportError:  # the planner alone: huggingface_hub's default, ~/.cache/huggingface
        home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        return Path(home) / "lmc" / "step_times"
    return Path(constants.HF_HOME) / "lmc" / "step_times"


def _config_folder(root: Path, config: dict) -> Path:
    text = json.dumps(config, sort_keys=True, indent=1)
    folder = root / "configs" / hashlib.sha256(text.encode()).hexdigest()[:20]
    path = folder / "config.json"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, text)
    return folder


def _read_cache(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache costs one recomputation, never a wrong figure
    answers: dict = {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    for text in ("error", "transfer"):
        if isinstance(data.get(text), str):
            answers[text] = data[text]
    return answers


def _write_cache(path: Path | None, answers: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, json.dumps(answers, sort_keys=True))
    except OSError:
        pass  # a read-only HF_HOME only costs the next plan the queries


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


__all__ = ["AIC_SYSTEMS", "MeasuredSteps", "RooflineSteps", "StepLayout", "StepTimes", "aic_config",
           "aic_quant_modes", "measured_unavailable", "step_times"]
