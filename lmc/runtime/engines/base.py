"""The one small interface every engine implements; the generated model.py wires one of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Protocol


@dataclass(frozen=True)
class GenerationParams:
    """Per-request sampling parameters (the LMI/TGI `parameters` object)."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    # OpenAI's (and vLLM's) penalties over the tokens generated so far, and its logit_bias ((id, bias) pairs).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # No EOS before this many new tokens (HF's min_new_tokens, vLLM's min_tokens); EOS not an end at all
    # (vLLM's ignore_eos, LMI's ignore_eos_token: fixed-length answers for benchmarks).
    min_new_tokens: int = 0
    ignore_eos: bool = False
    # OpenAI's logprobs: None off; k >= 0: each generated token's log-probability and the k most likely.
    logprobs: int | None = None
    return_full_text: bool = False
    # Whether tokenizing the prompt adds the tokenizer's special tokens (BOS...). False for chat prompts:
    # their template already wrote them (as vLLM and transformers' apply_chat_template do).
    add_special_tokens: bool = True


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    prompt: str
    params: GenerationParams = field(default_factory=GenerationParams)


@dataclass
class GenerationResult:
    id: str
    text: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str  # "length" | "stop" | "eos" | "cancelled"
    token_ids: list[int] = field(default_factory=list)
    # With params.logprobs: per generated token, (its log-probability, ((id, log-probability) of the most likely)).
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None


@dataclass(frozen=True)
class Piece:
    """Streamed text: what one generated token added (maybe held back until a character or a possible stop
    sequence is complete), that token's id and log-probability under the model, and whether it is the
    request's last piece (it comes with the finish, and may be empty: an EOS)."""

    text: str
    token_id: int | None = None
    log_prob: float | None = None
    last: bool = False
    # With params.logprobs: (token id, log-probability, ((id, log-probability) of the most likely)) for each
    # generated token since the previous piece, as GenerationResult.logprobs lists them (an EOS has none).
    logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] | None = None


# Called as tokens are produced: (request id, the new piece: a Piece, or its text alone).
TokenCallback = Callable[[str, "Piece | str"], None]
# Called by rank 0 before each step: the ids of the batch's requests whose answers are no longer wanted
# (the client left, the request timed out). Their rows stop, on every rank at the same step, and their
# results come back with finish_reason "cancelled".
CancelProbe = Callable[[], "Collection[str]"]


class Engine(Protocol):
    """A loaded model on one TP rank. All ranks of a group call `generate` in lockstep.

    lmc's workers answer with rank 0's results and pieces: the other ranks may leave out logprobs and
    not call `on_token`. Set `every_rank_answers` before `load` when every rank's answer is read (DJL's
    MPI mode returns the last rank's); engines whose groups are one process may ignore it."""

    every_rank_answers: bool

    def load(self, model_dir: Path, rank: int, world_size: int) -> None:
        """Load rank `rank`'s shard of the artifact in `model_dir` (only that shard file)."""

    def generate(self, batch: list[GenerationRequest], on_token: TokenCallback | None = None,
                 cancel_probe: CancelProbe | None = None) -> list[GenerationResult]:
        """Generate for a batch; results in the batch's order. Raises on a model failure."""

    # Engines that support continuous batching (hf, deepspeed without fused kernels) also have
    # running_batch(on_token, block_size) -> generate.RunningBatch: an empty batch that requests join
    # between decode steps (join), advanced one step at a time on every rank in lockstep (step, which
    # returns the rows that finished), its KV cache in blocks of `block_size` positions (the plan's
    # kv_cache.block_size) where it is paged; the worker's continuous loop (workers.py) drives it. Not
    # part of the protocol: the worker checks for it.

    def count_tokens(self, text: str) -> int:
        """Prompt length in tokens, to validate requests against the planned sequence length."""
