"""The batched decode loop: KV cache, left padding, per-request sampling, streaming, stop handling.

One loop serves every engine: hf and deepspeed run a transformers model through it, neuronx supplies
its own model step (`prefill`). Causal LMs are left-padded with an attention mask and position ids,
so a request decodes to the same tokens alone or in a batch; T5-style encoder-decoders run the
encoder once and decode from its outputs with the same loop.

With tensor parallelism every rank runs the loop over the same batch; rank 0 alone chooses the next
tokens and broadcasts them, so ranks can never diverge (sampling included) and all ranks reach the
same finish decisions from the same tokens.
"""

from __future__ import annotations

import inspect
import logging
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection

import torch
import torch.distributed as dist

from lmc.errors import InternalError
from lmc.runtime.engines.base import (CancelProbe, GenerationParams, GenerationRequest, GenerationResult, Piece,
                                      TokenCallback)

if TYPE_CHECKING:
    from lmc.runtime.engines.paged import Packed

log = logging.getLogger(__name__)
_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first new one (TGI uses 5 too)
_FAILED = -1  # broadcast instead of tokens when rank 0 could not choose them
_CANCELLED = -2  # broadcast instead of a row's token when its answer is no longer wanted
_MIN_TEMPERATURE = 1e-5  # below this, dividing the logits overflows: greedy, which it tends to anyway
# A prompt joining a running batch is prefilled this many positions at a time, one chunk between two
# decode steps, so a long prompt delays the rows already decoding by one chunk's time per step, not its whole.
PREFILL_CHUNK_TOKENS = 256


@dataclass
class _Row:
    request: GenerationRequest
    prompt_ids: list[int]
    generator: torch.Generator | None = None
    generated: list[int] = field(default_factory=list)
    text: str = ""
    streamed: str = ""
    finish: str | None = None
    stream_ok: bool = True
    cancelled: bool = False  # rank 0: the cancel probe named this row's request
    # Stop sequences count only if they end past this much of the text: the text before the
    # min_new_tokens-th token (as vLLM checks them only once min_tokens tokens exist).
    stop_from: int = 0
    # Incremental detokenization (as TGI does): the text is decoded in a window that starts a few
    # tokens before the new ones, so a tokenizer that drops a leading space (SentencePiece) or merges
    # byte tokens (byte fallback) decodes the new tokens as they read after their context; a window
    # ending in an incomplete character waits for the next token.
    prefix_offset: int = 0
    read_offset: int = 0
    # Rank 0's running state for the OpenAI penalties and logit_bias (made on first use, on the logits'
    # device): how often each token was generated, how many of `generated` that counts, and the bias.
    counts: torch.Tensor | None = None
    counted: int = 0
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # With params.logprobs: the entry for the token just chosen (kept once it is appended), and the list.
    pending_logprob: tuple[float, tuple[tuple[int, float], ...]] | None = None
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    logprobs_streamed: int = 0  # how many of `logprobs` went out with streamed pieces

    @property
    def params(self) -> GenerationParams:
        return self.request.params


# A model step supplied by the engine instead of a transformers forward: given the rows' prompt ids and
# the pad id, run the prompt and return (next-token logits [rows, vocab], advance), where
# advance(tokens [rows]) feeds one token per row and returns the next logits.
Prefill = Callable[[list[list[int]], int], tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]


class DecodeLoop:
    """Generation over a loaded model on one rank. `group` None means no tensor parallelism. With
    `prefill`, the engine runs the model (transformers-neuronx) and this loop does the rest.

    Rank 0 chooses the tokens (and broadcasts them); only rank 0 streams pieces and computes logprobs,
    unless `every_rank_answers` (DJL's MPI mode answers with the last rank's output): then every rank
    does, from its own copy of the gathered logits.

    `compact` (transformers models whose KV cache is a transformers Cache): a row that finishes (end of
    sequence, stop, length, cancelled) leaves the run at once, its KV cache rows dropped, so the rows
    still decoding stop paying for it, as in TGI's filtered batches. Off where the model keeps its own
    cache (DeepSpeed's fused kernels) and with an engine's `prefill` (fixed compiled batch sizes)."""

    def __init__(self, model, tokenizer, *, max_sequence_length: int, device: torch.device, eos_token_ids: set[int],
                 rank: int = 0, world_size: int = 1, group=None, prefill: Prefill | None = None,
                 every_rank_answers: bool = False, compact: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.device = device
        self.eos_token_ids = set(eos_token_ids)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.prefill = prefill
        self.every_rank_answers = every_rank_answers
        self.compact = compact and prefill is None
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_token_ids) if self.eos_token_ids else 0)
        self.encoder_decoder = False
        # Continuous batching keeps each row's KV cache in blocks of its own (paged.py) where the model
        # qualifies: decided at the first running_batch.
        self.paged: bool | None = None
        if prefill is not None:
            return
        config = model.config
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        self.decoder_start = getattr(config, "decoder_start_token_id", None)
        if self.encoder_decoder and self.decoder_start is None:
            self.decoder_start = config.pad_token_id
        accepted = set(inspect.signature(model.forward).parameters)
        self.pass_positions = "position_ids" in accepted and not self.encoder_decoder
        self.pass_logits_to_keep = "logits_to_keep" in accepted

    # -- tokens -------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # -- the loop -----------------------------------------------------------------------------------------

    def generate(self, batch: list[GenerationRequest], on_token: TokenCallback | None = None,
                 cancel_probe: CancelProbe | None = None, max_rows: int | None = None,
                 same_length: bool = False) -> list[GenerationResult]:
        """Decode `batch`, in runs: left padding puts every row's positions at the widest prompt's, so
        a run keeps its widest prompt plus its largest max_new_tokens within max_sequence_length (the
        positions the model has, and the KV cache the plan reserved), and at most `max_rows` rows.
        `same_length` (a model that cannot mask left padding): each run holds prompts of one length.
        `cancel_probe` (rank 0's; see CancelProbe) is asked before each run, whose cancelled rows are left
        out, and before each step."""
        rows = [self._row(request) for request in batch]
        if same_length:
            rows.sort(key=lambda row: len(row.prompt_ids))  # stable: equal lengths stay in arrival order
        results: dict[str, GenerationResult] = {}
        lengths = [len(row.prompt_ids) for row in rows]
        for run in pack_batches(rows, lengths, [row.params.max_new_tokens for row in rows],
                                max_rows or len(rows) or 1, self.max_sequence_length, same_length):
            live = self._drop_cancelled(run, cancel_probe)
            if live:
                self._decode(live, on_token, cancel_probe)
            for row in run:
                results[row.request.id] = self._result(row)
        return [results[request.id] for request in batch]

    def _drop_cancelled(self, run: list[_Row], cancel_probe: CancelProbe | None) -> list[_Row]:
        """`run` without the rows rank 0's probe names (they finish "cancelled" unprefilled), the same on
        every rank: rank 0 broadcasts which."""
        if cancel_probe is None and self.world_size == 1:
            return run
        gone = torch.zeros(len(run), dtype=torch.long, device=self.device)
        if self.rank == 0 and cancel_probe is not None:
            names = _ask(cancel_probe)
            gone.copy_(torch.tensor([row.request.id in names for row in run], dtype=torch.long))
        if self.world_size > 1:
            source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            dist.broadcast(gone, src=source, group=self.group)
        for row, flag in zip(run, gone.tolist()):
            if flag:
                row.finish = "cancelled"
        return [row for row in run if row.finish is None]

    def _decode(self, rows: list[_Row], on_token: TokenCallback | None, cancel_probe: CancelProbe | None = None
                ) -> None:
        """Prefill `rows` and decode them until each has finished (in place): a RunningBatch that no
        row joins after the first."""
        batch = RunningBatch(self, on_token)
        with torch.inference_mode():
            batch.start(rows)
            while batch.rows:
                batch.step(cancel_probe)

    def running_batch(self, on_token: TokenCallback | None = None, block_size: int | None = None) -> "RunningBatch":
        """An empty batch for iteration-level scheduling (continuous batching): rows join it between
        decode steps (RunningBatch.join) and leave as they finish; its KV cache is counted (and, paged, held)
        in blocks of `block_size` positions (paged.BLOCK_SIZE by default). Causal transformers models only."""
        if self.prefill is not None or self.encoder_decoder or not self.compact:
            raise InternalError("continuous batching needs a causal transformers model with a transformers KV cache")
        from lmc.runtime.engines import paged

        if self.paged is None:
            self.paged = paged.enable(self.model)
        return RunningBatch(self, on_token, block_size or paged.BLOCK_SIZE)

    def _row(self, request: GenerationRequest) -> _Row:
        ids = self.encode(request.prompt, request.params.add_special_tokens)
        if not ids:
            raise ValueError("the prompt is empty after tokenization; give at least one token of input")
        total = len(ids) + request.params.max_new_tokens
        if total > self.max_sequence_length:
            raise ValueError(f"the prompt is {len(ids)} tokens and max_new_tokens is {request.params.max_new_tokens}: "
                             f"{total} exceeds the maximum sequence length {self.max_sequence_length}")
        row = _Row(request, ids)
        if not self.encoder_decoder:  # a continuation of the prompt: its last tokens are the context
            row.prefix_offset, row.read_offset = max(len(ids) - _CONTEXT_TOKENS, 0), len(ids)
        if self.rank == 0 and request.params.do_sample:
            seed = request.params.seed if request.params.seed is not None else random.getrandbits(63)
            row.generator = torch.Generator(device=self.device).manual_seed(seed)
        return row

    def _prefill_seq2seq(self, rows: list[_Row]):
        from transformers import DynamicCache, EncoderDecoderCache

        width = max(len(row.prompt_ids) for row in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row.prompt_ids)] = torch.tensor(row.prompt_ids)
            mask[i, :len(row.prompt_ids)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        state = {"encoded": self.model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state,
                 "mask": mask}
        cache = EncoderDecoderCache(DynamicCache(config=self.model.config), DynamicCache(config=self.model.config))

        def forward(decoder_ids):
            out = self.model(encoder_outputs=(state["encoded"],), attention_mask=state["mask"],
                             decoder_input_ids=decoder_ids, past_key_values=cache, use_cache=True)
            return out.logits[:, -1, :].float()

        def keep(indices: torch.Tensor) -> None:
            cache.batch_select_indices(indices)
            state["encoded"], state["mask"] = state["encoded"][indices], state["mask"][indices]

        start = torch.full((len(rows), 1), self.decoder_start, dtype=torch.long, device=self.device)
        return forward(start), lambda tokens: forward(tokens[:, None]), keep

    # -- choosing tokens ----------------------------------------------------------------------------------

    def _next_tokens(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        tokens = torch.empty(len(rows), dtype=torch.long, device=self.device)
        failure = None
        if self.rank == 0:
            try:
                for i, row in enumerate(rows):
                    if row.finish is None and row.cancelled:
                        tokens[i] = _CANCELLED
                        continue
                    early = not row.params.ignore_eos and len(row.generated) < row.params.min_new_tokens
                    tokens[i] = self.pad_id if row.finish is not None else choose_token(
                        logits[i], row.params, self._context(row), row.generator, self._counts(row, logits[i]),
                        self._bias(row, logits[i]), tuple(self.eos_token_ids) if early else ())
                    if row.finish is None and row.params.logprobs is not None:
                        row.pending_logprob = _logprob_entry(logits[i], int(tokens[i]), row.params.logprobs)
            except Exception as exc:  # the other ranks wait in the broadcast: tell them, then fail together
                failure = exc
                tokens.fill_(_FAILED)
        if self.world_size > 1:
            source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            dist.broadcast(tokens, src=source, group=self.group)
        if failure is not None:
            raise failure
        if len(rows) and int(tokens[0]) == _FAILED:
            raise RuntimeError("rank 0 could not choose the next tokens (see its log)")
        for i in (tokens == _CANCELLED).nonzero().flatten().tolist():  # on every rank alike
            rows[i].finish = "cancelled"
            tokens[i] = self.pad_id
        if self.rank != 0 and self.every_rank_answers:
            for i, row in enumerate(rows):
                if row.finish is None and row.params.logprobs is not None:
                    row.pending_logprob = _logprob_entry(logits[i], int(tokens[i]), row.params.logprobs)
        return tokens

    @staticmethod
    def _counts(row: _Row, logits: torch.Tensor) -> torch.Tensor | None:
        """How often each token was generated, for the frequency/presence penalties: kept up to date one
        token per step, not recounted."""
        if not (row.params.frequency_penalty or row.params.presence_penalty):
            return None
        vocab = logits.shape[-1]
        if row.counts is None:
            row.counts = torch.zeros(vocab, dtype=torch.long, device=logits.device)
        for token in row.generated[row.counted:]:
            if token < vocab:
                row.counts[token] += 1
        row.counted = len(row.generated)
        return row.counts

    @staticmethod
    def _bias(row: _Row, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if row.bias is None and row.params.logit_bias:
            row.bias = _bias_tensors(row.params.logit_bias, logits)
        return row.bias

    def _context(self, row: _Row) -> list[int]:
        """The ids repetition_penalty looks at (as HF does: the decoder's input)."""
        if self.encoder_decoder:
            return [self.decoder_start, *row.generated]
        return row.prompt_ids + row.generated

    # -- text, stop sequences, streaming ------------------------------------------------------------------

    def _append(self, row: _Row, token: int, stream: TokenCallback | None, logits: torch.Tensor | None = None) -> None:
        """Add the chosen `token` to the row; when streaming, send the text it completes with the token's
        log-probability under `logits` (this step's, before penalties and temperature)."""
        if token in self.eos_token_ids and not row.params.ignore_eos:
            row.finish = "eos"
        else:
            row.generated.append(token)
            if row.pending_logprob is not None:
                row.logprobs.append(row.pending_logprob)
                row.pending_logprob = None
            if len(row.generated) == row.params.min_new_tokens:
                row.stop_from = len(row.text)
            self._extend_text(row, final=False)
            early = len(row.generated) < row.params.min_new_tokens
            cut = None if early else _first_stop(row.text, row.params.stop, row.stop_from)
            if cut is not None:
                row.text = row.text[:cut]
                row.finish = "stop"
            elif len(row.generated) >= row.params.max_new_tokens:
                row.finish = "length"
        if row.finish in ("eos", "length"):
            self._extend_text(row, final=True)  # what an incomplete character was holding back
        if stream is not None and row.stream_ok:
            final = row.finish is not None
            upto = len(row.text) if final else _safe_prefix(row.text, row.params.stop)
            piece = ""
            if upto > len(row.streamed) and row.text.startswith(row.streamed):
                piece = row.text[len(row.streamed):upto]
            if piece or final:  # the last piece always goes, empty or not: it carries the finishing token
                row.streamed += piece
                entries = None
                if row.params.logprobs is not None:  # those of the tokens this piece's text covers
                    start, row.logprobs_streamed = row.logprobs_streamed, len(row.logprobs)
                    entries = tuple((token_id, value, top) for token_id, (value, top)
                                    in zip(row.generated[start:], row.logprobs[start:]))
                try:
                    stream(row.request.id, Piece(piece, token, _log_prob(logits, token), last=final, logprobs=entries))
                except Exception:  # a broken client must not break the lockstep with the other ranks
                    log.exception("streaming callback failed for request %s; no more pieces for it", row.request.id)
                    row.stream_ok = False

    def _extend_text(self, row: _Row, final: bool) -> None:
        ids = row.generated if self.encoder_decoder else row.prompt_ids + row.generated
        before = self.decode(ids[row.prefix_offset:row.read_offset])
        after = self.decode(ids[row.prefix_offset:])
        if len(after) > len(before) and (final or not after.endswith(_REPLACEMENT)):
            row.text += after[len(before):]
            row.prefix_offset, row.read_offset = row.read_offset, len(ids)

    def _result(self, row: _Row) -> GenerationResult:
        text = row.request.prompt + row.text if row.params.return_full_text else row.text
        return GenerationResult(id=row.request.id, text=text, prompt_tokens=len(row.prompt_ids),
                                generated_tokens=len(row.generated), finish_reason=row.finish or "length",
                                token_ids=list(row.generated),
                                logprobs=list(row.logprobs) if row.params.logprobs is not None else None)


class RunningBatch:
    """The rows decoding together on one rank, one `step` at a time: the decode loop itself, shared by
    dynamic batching (DecodeLoop.generate: rows `start` together, none join later) and continuous
    batching (rows `join` between steps: their prompts are prefilled a chunk per step, then they decode
    with the running rows; a finished row leaves at once). Continuous batching keeps each row's KV
    cache in blocks of its own (_PagedState, paged.py) where the model qualifies; otherwise, and for
    dynamic batches, the rows share a left-padded DynamicCache (_CausalState: a joining row's cache is
    merged in, a leaving row's dropped, and the columns only finished rows needed are cut off). Every
    rank of a group makes the same calls in the same order; rank 0 chooses the tokens and broadcasts
    them."""

    def __init__(self, loop: DecodeLoop, on_token: TokenCallback | None, block_size: int | None = None):
        self.loop = loop
        self.block_size = block_size  # continuous batching: the KV cache's block, in positions
        self.stream = on_token if loop.rank == 0 or loop.every_rank_answers else None
        self.rows: list[_Row] = []
        self.logits: torch.Tensor | None = None  # [rows, vocab]: each row's next-token logits
        self.advance: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.keep: Callable[[torch.Tensor], None] | None = None
        self.state: _CausalState | None = None  # continuous batching: the running rows' cache
        # Joined, waiting for or in their prefill: rows that join before their group's prefill starts
        # share it (one forward for all); the state is made when it starts.
        self.pending: list[tuple[list[_Row], _CausalState | None]] = []
        self.decoded: list[int] = []  # rows decoded at each step since the last read (for the metrics)
        self.cache = None  # continuous batching on a paged model: the rows' block pool (paged.PagedCache)

    def __len__(self) -> int:
        return len(self.rows) + sum(len(rows) for rows, _ in self.pending)

    def result(self, row: _Row) -> GenerationResult:
        return self.loop._result(row)

    def kv_tokens(self) -> int:
        """Positions the KV cache holds for its longest row, padding included where rows share a padded
        cache (the running rows' width)."""
        return 0 if self.state is None else self.state.width()

    def kv_blocks(self) -> int:
        """KV-cache blocks the rows hold now: their blocks of the pool where the cache is paged (joining rows'
        included), else the shared padded cache's rows x width in blocks."""
        if self.cache is not None:
            return self.cache.used()
        return -(-len(self.rows) * self.kv_tokens() // self.block_size)

    def _state(self, rows: list[_Row]) -> "_CausalState | _PagedState":
        """The cache state for rows joining: their own blocks of the batch's pool where the model qualifies."""
        if not self.loop.paged:
            return _CausalState(self.loop, rows)
        if self.cache is None:
            from lmc.runtime.engines.paged import PagedCache

            self.cache = PagedCache(self.block_size)
        return _PagedState(self.loop, rows, self.cache)

    # -- dynamic: one set of rows

    def start(self, rows: list[_Row]) -> None:
        loop = self.loop
        self.rows = list(rows)
        if loop.prefill is not None:
            self.logits, self.advance = loop.prefill([row.prompt_ids for row in rows], loop.pad_id)
        elif loop.encoder_decoder:
            self.logits, self.advance, self.keep = loop._prefill_seq2seq(rows)
        else:
            state = _CausalState(loop, rows)
            while self.logits is None:
                self.logits = state.prefill(None)
            self.advance, self.keep = state.advance, state.keep
        if not loop.compact:
            self.keep = None

    # -- continuous: rows join between steps

    def join(self, requests: list[GenerationRequest]) -> None:
        """Queue `requests` to join at the coming steps (their prefill runs a chunk per step). Raises
        ValueError for a prompt that does not fit (nothing joins then)."""
        rows = [self.loop._row(request) for request in requests]
        if self.pending and self.pending[-1][1] is None:
            self.pending[-1][0].extend(rows)
        elif rows:
            self.pending.append((rows, None))

    def _first_pending(self) -> tuple[list[_Row], "_CausalState | _PagedState"]:
        """The first joining group's rows and cache state (made when its prefill starts)."""
        rows, state = self.pending[0]
        if state is None:
            state = self._state(rows)
            self.pending[0] = (rows, state)
        return rows, state

    def _merge_first_pending(self, logits: torch.Tensor) -> None:
        """The first joining group, prefilled (`logits`: its rows' next-token logits), joins the running rows."""
        rows, state = self.pending.pop(0)
        if not self.rows:
            self.rows, self.logits, self.state = rows, logits, state
        else:
            self.state.absorb(state)
            self.rows += rows
            self.logits = torch.cat([self.logits, logits])
        self.advance, self.keep = self.state.advance, self.state.keep

    def _prefill_pending(self) -> None:
        """One chunk of the first joining group's prefill; when it completes, its rows merge into the
        running rows (or wait, where this model's cache cannot be merged, until the running rows end)."""
        _, state = self._first_pending()
        if self.rows and not state.mergeable:
            return
        logits = state.prefill(PREFILL_CHUNK_TOKENS)
        if logits is not None:
            self._merge_first_pending(logits)

    # -- one step

    def step(self, cancel_probe: CancelProbe | None = None,
             chosen: Callable[[list[_Row]], None] | None = None) -> list[_Row]:
        """Prefill a chunk of joining rows, then choose every running row's next token and run the model
        one position further for those that go on. Returns the rows that finished in this step; `chosen`
        gets them before the forward (the tokens are chosen and the finished rows out: their answers can
        go while it runs)."""
        loop = self.loop
        if self.pending and not self._fused():
            self._prefill_pending()
        if not self.rows:
            return []
        if loop.rank == 0 and cancel_probe is not None:
            names = _ask(cancel_probe)
            for row in self.rows:
                row.cancelled = row.cancelled or row.request.id in names
        running = [row.finish is None for row in self.rows]
        tokens = loop._next_tokens(self.logits, self.rows)
        for i, (row, token) in enumerate(zip(self.rows, tokens.tolist())):
            if row.finish is None:
                loop._append(row, token, self.stream, self.logits[i] if self.stream is not None else None)
        finished = [row for row, was in zip(self.rows, running) if was and row.finish is not None]
        self.decoded.append(sum(running))
        if all(row.finish is not None for row in self.rows):
            if self.state is not None:
                self.state.release()
            self.rows, self.logits, self.state, self.advance, self.keep = [], None, None, None, None
            if chosen is not None:
                chosen(finished)
            return finished
        if self.keep is not None and finished:
            # Every rank alike: finishing follows the broadcast tokens and the text every rank decodes.
            live = [i for i, row in enumerate(self.rows) if row.finish is None]
            self.keep(torch.tensor(live, dtype=torch.long, device=loop.device))
            self.rows, tokens = [self.rows[i] for i in live], tokens[live]
        if chosen is not None:
            chosen(finished)
        if self.pending and self._fused():
            self._advance_joining(tokens)
        else:
            self.logits = self.advance(tokens)
        return finished

    def _fused(self) -> bool:
        """Whether joining rows prefill in the running rows' decode forward: both keep their own blocks
        (paged), and there are running rows."""
        return bool(self.rows) and isinstance(self.state, _PagedState)

    def _advance_joining(self, tokens: torch.Tensor) -> None:
        """The running rows one position further and a chunk of the first joining group's prefill, in one
        forward; when the chunk ends its prompts, the group's rows join the running rows."""
        _, state = self._first_pending()
        self.logits, joined = self.state.advance_joining(tokens, state, PREFILL_CHUNK_TOKENS)
        if joined is not None:
            self._merge_first_pending(joined)


class _CausalState:
    """A causal LM's rows on one rank: their KV cache (a transformers DynamicCache, rows left-padded to
    the longest), attention mask and next positions. Rows can be dropped (keep), another state's rows
    merged in (absorb), and the columns no remaining row needs cut off (in keep)."""

    def __init__(self, loop: DecodeLoop, rows: list[_Row]):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.loop = loop
        width = max(len(row.prompt_ids) for row in rows)
        ids = torch.full((len(rows), width), loop.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt_ids):] = torch.tensor(row.prompt_ids)
            mask[i, width - len(row.prompt_ids):] = 1
        self.ids, self.mask = ids.to(loop.device), mask.to(loop.device)
        self.prompt_positions = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 1)
        self.positions: torch.Tensor | None = None  # [rows, 1] once prefilled: each row's last position
        self.done = 0  # prompt columns prefilled so far
        self.cache = DynamicCache(config=loop.model.config)
        # Sliding-window layers keep a running count of their own: their rows are not merged or cut.
        self.mergeable = all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": mask, "past_key_values": self.cache, "use_cache": True}
        if self.loop.pass_positions:
            kwargs["position_ids"] = positions
        if self.loop.pass_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.loop.model(**kwargs).logits[:, -1, :].float()

    def prefill(self, chunk: int | None) -> torch.Tensor | None:
        """Run the next `chunk` prompt columns (all that are left: None); the rows' next-token logits once
        the whole prompt has run, else None."""
        width = self.ids.shape[1]
        end = width if chunk is None else min(width, self.done + chunk)
        logits = self._forward(self.ids[:, self.done:end], self.mask[:, :end], self.prompt_positions[:, self.done:end])
        self.done = end
        if end < width:
            return None
        self.positions = self.prompt_positions[:, -1:]
        self.ids = self.prompt_positions = None
        return logits

    def advance(self, tokens: torch.Tensor) -> torch.Tensor:
        ones = torch.ones((len(tokens), 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=-1)
        self.positions = self.positions + 1
        return self._forward(tokens[:, None], self.mask, self.positions)

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the rows at `indices`, then drop the leading columns that are padding for all of them
        (the positions only rows that left needed)."""
        self.cache.batch_select_indices(indices)
        self.mask, self.positions = self.mask[indices], self.positions[indices]
        if not self.mergeable:
            return
        used = self.mask.any(0).nonzero()
        lead = int(used[0]) if len(used) else 0
        if lead:
            self.mask = self.mask[:, lead:]
            for layer in self.cache.layers:
                if layer.is_initialized:
                    layer.keys, layer.values = layer.keys[..., lead:, :], layer.values[..., lead:, :]

    def width(self) -> int:
        return int(self.mask.shape[1])

    def release(self) -> None:
        """Nothing to give back: the cache goes with this state."""

    def absorb(self, other: "_CausalState") -> None:
        """Append `other`'s (prefilled) rows after these: both left-padded to the wider one's columns."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def widen(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - tensor.shape[dim]
            if not missing:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        self.mask = torch.cat([widen(self.mask, 1), widen(other.mask, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([widen(mine.keys, -2), widen(theirs.keys, -2)])
            mine.values = torch.cat([widen(mine.values, -2), widen(theirs.values, -2)])


class _PagedState:
    """Rows whose KV cache is their own (paged.Rows: blocks of the batch's PagedCache), on a model switched
    to paged attention: a forward packs the rows' tokens into one sequence, nothing padded. Prompts are
    prefilled in the columns _CausalState would use (right-aligned: a chunk covers the same prompt
    positions), so every row's last prompt token runs in the last chunk. The interface of _CausalState."""

    mergeable = True

    def __init__(self, loop: DecodeLoop, rows: list[_Row], cache):
        from lmc.runtime.engines.paged import Rows

        self.loop = loop
        self.prompts: list[list[int]] | None = [row.prompt_ids for row in rows]
        self.columns = max(len(prompt) for prompt in self.prompts)
        self.done = 0  # prompt columns prefilled so far
        self.rows = Rows(cache)
        self.rows.add([len(prompt) for prompt in self.prompts])

    def _forward(self, ids: torch.Tensor, positions: list[int], packed, logits_to_keep) -> torch.Tensor:
        cache, device = self.rows.cache, self.loop.device
        with cache.forward(packed):
            # A 4-D mask: transformers builds none (the attention keeps each row to itself).
            out = self.loop.model(input_ids=ids[None].to(device), position_ids=torch.tensor([positions], device=device),
                                  attention_mask=_NO_MASK, past_key_values=cache, use_cache=True,
                                  logits_to_keep=logits_to_keep, lmc_packed=packed)
        return out.logits[0].float()

    def _chunk(self, chunk: int | None) -> tuple[list[int], list[int], Packed, list[int] | None]:
        """The next `chunk` prompt columns (all that are left: None): their tokens, positions and layout, and
        where each row's last prompt token lies among the tokens when this chunk ends the prompts (else None)."""
        end = self.columns if chunk is None else min(self.columns, self.done + chunk)
        pieces, ids, positions, last = [], [], [], []
        for prompt in self.prompts:
            offset = self.columns - len(prompt)
            start, stop = max(0, self.done - offset), max(0, end - offset)
            pieces.append((start, stop))
            ids += prompt[start:stop]
            positions += range(start, stop)
            last.append(len(ids) - 1)  # the row's last prompt token, in the last chunk
        packed = self.rows.prefill_layout(pieces, self.loop.device)
        self.done = end
        if end < self.columns:
            return ids, positions, packed, None
        self.prompts = None
        return ids, positions, packed, last

    def prefill(self, chunk: int | None) -> torch.Tensor | None:
        ids, positions, packed, last = self._chunk(chunk)
        logits = self._forward(torch.tensor(ids), positions, packed,
                               1 if last is None else torch.tensor(last, device=self.loop.device))
        return None if last is None else logits

    def advance(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = list(self.rows.lengths)
        return self._forward(tokens, positions, self.rows.decode_layout(self.loop.device), 0)

    def advance_joining(self, tokens: torch.Tensor, joining: "_PagedState", chunk: int | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`advance` and the next chunk of `joining`'s prefill in one forward: these rows' next-token logits,
        and `joining`'s once its prompts have run (else None)."""
        positions = list(self.rows.lengths)
        decode = self.rows.decode_layout(self.loop.device)
        ids, prompt_positions, prefill, last = joining._chunk(chunk)
        rows = len(tokens)
        keep = list(range(rows)) + ([] if last is None else [rows + i for i in last])
        logits = self._forward(torch.cat([tokens.cpu(), torch.tensor(ids, dtype=torch.long)]),
                               positions + prompt_positions, decode.join(prefill),
                               torch.tensor(keep, device=self.loop.device))
        return logits[:rows], None if last is None else logits[rows:]

    def keep(self, indices: torch.Tensor) -> None:
        self.rows.keep(indices.tolist())

    def absorb(self, other: "_PagedState") -> None:
        self.rows.extend(other.rows)

    def width(self) -> int:
        return max(self.rows.lengths, default=0)

    def release(self) -> None:
        self.rows.release()


_NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


def _ask(cancel_probe: CancelProbe) -> Collection[str]:
    """The probe's answer; nothing when it fails (the other ranks are waiting in the next broadcast)."""
    try:
        return cancel_probe()
    except Exception:
        log.exception("the cancel probe failed; no row is cancelled this step")
        return ()


def _bias_tensors(logit_bias: tuple[tuple[int, float], ...], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The ids were checked against the tokenizer; logits padded wider or narrower than it are cut to fit.
    pairs = [(token, bias) for token, bias in logit_bias if token < logits.shape[-1]]
    return (torch.tensor([token for token, _ in pairs], dtype=torch.long, device=logits.device),
            torch.tensor([bias for _, bias in pairs], dtype=torch.float32, device=logits.device))


def _log_prob(logits: torch.Tensor | None, token: int) -> float | None:
    """log softmax(logits)[token] without a vocabulary-sized result; None when not finite (JSON has no NaN)
    or not computable: a streamed log-probability must never fail the batch."""
    if logits is None:
        return None
    try:
        value = float(logits[token].float() - torch.logsumexp(logits.float(), -1))
    except Exception:  # an index past the logits, an allocation failure
        log.exception("could not compute the log-probability of token %d", token)
        return None
    return value if math.isfinite(value) else None


def _logprob_entry(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """`token`'s log-probability under the model (before penalties and temperature, as vLLM's default) and
    the `top` most likely tokens with theirs. Values that are not finite (masked or NaN logits) become
    -9999.0, as vLLM reports them: JSON has no infinity."""
    log_probs = torch.log_softmax(logits.float(), -1).nan_to_num(nan=-9999.0, neginf=-9999.0)
    best = torch.topk(log_probs, min(top, log_probs.numel())) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return float(log_probs[token]), alternatives


def choose_token(logits: torch.Tensor, params: GenerationParams, context: list[int],
                 generator: torch.Generator | None, counts: torch.Tensor | None = None,
                 bias: tuple[torch.Tensor, torch.Tensor] | None = None, suppress: tuple[int, ...] = ()) -> int:
    """One row's next token: logit_bias, repetition penalty (HF's, over `context`), frequency and presence
    penalties (OpenAI's, over `counts` of the generated tokens, as vLLM applies them), then greedy or
    temperature → top-k → top-p sampling (HF order). `bias` is params.logit_bias as (ids, values) tensors;
    `suppress` lists tokens that may not be chosen now (EOS before min_new_tokens)."""
    scores = logits.float().nan_to_num(nan=float("-inf"))  # a copy; NaN (an fp16 overflow) never wins
    if suppress:
        scores[[token for token in suppress if token < scores.numel()]] = float("-inf")
    if bias is None and params.logit_bias:
        bias = _bias_tensors(params.logit_bias, scores)
    if bias is not None:
        scores.index_add_(0, *bias)
    if params.repetition_penalty != 1.0 and context:
        ids = torch.tensor(sorted(set(context)), dtype=torch.long, device=scores.device)
        picked = scores[ids]
        penalty = params.repetition_penalty
        scores[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    if counts is not None and (params.frequency_penalty or params.presence_penalty):
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if not params.do_sample or params.temperature < _MIN_TEMPERATURE:
        return int(torch.argmax(scores))
    greedy = int(torch.argmax(scores))
    scores = scores / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        remove = cumulative <= 1.0 - params.top_p
        remove[-1] = False  # always keep the most likely token
        scores = scores.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    probs = scores.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return greedy  # nothing to sample from (every score -inf, or overflowed): the most likely token
    return int(torch.multinomial(probs, 1, generator=generator))


def _first_stop(text: str, stops: tuple[str, ...], ends_after: int = 0) -> int | None:
    """Where the first stop sequence ending past `ends_after` starts in `text` (None: no such stop)."""
    hits = [index for index in (text.find(stop, max(0, ends_after - len(stop) + 1)) for stop in stops) if index >= 0]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` can be streamed now: not an incomplete character, not a possible stop's start."""
    end = len(text)
    while end and text[end - 1] == _REPLACEMENT:
        end -= 1
    complete = text[:end]  # a stop's start may sit just before an incomplete character
    for stop in stops:
        for k in range(min(len(stop) - 1, len(complete)), 0, -1):
            if complete.endswith(stop[:k]):
                end = min(end, len(complete) - k)
                break
    return end


def pack_batches(items: list, lengths: list[int], new_tokens: list[int], max_rows: int, positions: int,
                 same_length: bool = False) -> list[list]:
    """Split `items` (in order) into runs of at most `max_rows` whose widest prompt (`lengths`) plus
    largest `new_tokens` fits `positions` (and, with `same_length`, whose prompts are all one length).
    An item too long on its own runs alone (the caller checks it)."""
    runs: list[list] = []
    current: list = []
    width = longest = 0
    for item, n, m in zip(items, lengths, new_tokens):
        w, l = max(width, n), max(longest, m)
        if current and (len(current) == max_rows or w + l > positions or (same_length and n != width)):
            runs.append(current)
            current, w, l = [], n, m
        current.append(item)
        width, longest = w, l
    if current:
        runs.append(current)
    return runs
