"""Speculative decoding in the plan: tokens per step from the acceptance rate, the verify and draft costs,
the proposer's memory, and the batch above which it stops paying.

A step proposes k tokens per sequence; the target checks them (and its own next token) in one forward
pass. With a per-position acceptance rate α, a step yields E = (1 − α^(k+1)) / (1 − α) tokens
(Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", arXiv:2211.17192, eq. 1).
    verify = tpot(B) + the GEMM FLOPs of k·B more tokens (the weights are read once either way)
    draft  = k proposer steps at batch B: 0 for ngram (a host-side lookup in the prompt), k steps of the
             draft model or the EAGLE-3 head (their own decode step, lmc's latency model), k passes of the
             checkpoint's MTP layers (their share of the target's step)
    TPOT   = (verify + draft) / E
Memory: the proposer's weights, and its attention layers' KV in the same pool (proposer_kv_share).
At small batches the step is memory-bound and verify ≈ tpot(B): TPOT falls by about E. As the batch grows
the k·B extra tokens make the step compute-bound and the gain shrinks; past the break-even batch
speculation costs time, and the planner turns it off there (the plan says so).
"""

from __future__ import annotations

from collections.abc import Callable

from lmc.errors import SpecValueError
from lmc.planner.facts import EngineFacts, HardwareFacts, ModelFacts, SpeculativeFacts

# Published acceptance rates, per proposed position, used when the spec gives none.
DEFAULT_ACCEPTANCE: dict[str, tuple[float, str]] = {
    "mtp": (0.85, "DeepSeek-V3 technical report (arXiv:2412.19437, section 5.4.3): the second token's acceptance "
                  "rate is 85-90% across generation topics; the low end"),
    "eagle3": (0.7, "EAGLE-3 (Li et al., arXiv:2503.01840) reports acceptance lengths of 5-7 tokens with tree "
                    "drafting; vLLM drafts a chain, which accepts fewer: 0.7 per position (2.5 tokens a step at k=3)"),
    "draft": (0.6, "Leviathan et al. (arXiv:2211.17192, table 3) measure 0.5-0.9 across draft/target pairs; "
                   "0.6, toward the low end"),
    "ngram": (0.3, "prompt lookup accepts what the output repeats of the prompt: much on summaries and code edits, "
                   "little on open chat; 0.3, the low end (vLLM's docs rate n-gram's gains as modest)"),
}
# vLLM's speculative methods for the spec's names (vllm/config/speculative.py SpeculativeMethod).
# Batches scanned for the break-even point (the search plans up to 256 sequences per replica).
BREAK_EVEN_SCAN = 512
VLLM_METHOD = {"ngram": "ngram", "draft": "draft_model", "eagle3": "eagle3", "mtp": "mtp"}


def acceptance(method: str, given: float | None) -> tuple[float, str]:
    """The acceptance rate to plan with and where it comes from."""
    if given is not None:
        return given, "speculative.acceptance_rate in the spec"
    return DEFAULT_ACCEPTANCE[method]


def check_speculative(model: ModelFacts, key: str = "speculative") -> None:
    """The method can run on this model: MTP needs the checkpoint's MTP layers, a draft the base's vocabulary."""
    spec = model.speculative
    if spec is None:
        return
    if spec.method == "mtp" and not model.mtp_layers:
        raise SpecValueError(f"{key}.method", "mtp", f"{model.id} carries no multi-token-prediction layers "
                                                     "(config.json num_nextn_predict_layers is 0 or absent); use "
                                                     "ngram, draft or eagle3")
    draft = spec.draft
    if draft is not None and draft.vocab_size != model.vocab_size:
        what = "draft model" if spec.method == "draft" else "EAGLE-3 head"
        raise SpecValueError(f"{key}.model", spec.draft_source, f"the {what}'s vocabulary has {draft.vocab_size} "
                                                                f"tokens, the base's {model.vocab_size}: it needs "
                                                                "the base's tokenizer")


def tokens_per_step(spec: SpeculativeFacts) -> float:
    a, k = spec.acceptance_rate, spec.num_tokens
    return (1 - a ** (k + 1)) / (1 - a)


def draft_bytes(model: ModelFacts, engine: EngineFacts, dtype: str, tp: int, hardware: HardwareFacts) -> int:
    """Per-device bytes of the proposer's weights: the draft or head at the plan's TP, or the MTP layers."""
    from lmc.planner.memory import weight_bytes

    spec = model.speculative
    if spec is None or spec.method == "ngram":
        return 0
    if spec.method == "mtp":
        return weight_bytes(model, engine, dtype, tp, hardware) * model.mtp_layers // model.layers
    assert spec.draft is not None  # the schema requires `model` for draft and eagle3
    return weight_bytes(spec.draft, engine, dtype, tp, hardware)


def proposer_kv_share(model: ModelFacts, tp: int, kv_dtype: str) -> float:
    """The proposer's KV bytes per token over the model's: vLLM gives the draft's, head's or MTP layers'
    attention their blocks in the same pool (0 for ngram, which has no layers)."""
    from lmc.planner.memory import kv_bytes_per_token

    spec = model.speculative
    if spec is None or spec.method == "ngram":
        return 0.0
    if spec.method == "mtp":
        return model.mtp_layers / model.layers
    assert spec.draft is not None
    return kv_bytes_per_token(spec.draft, tp, kv_dtype) / kv_bytes_per_token(model, tp, kv_dtype)


def speculative_tpot_ms(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                        batch: int, input_tokens: int, output_tokens: int, dp: int, plain_ms: float) -> float:
    """TPOT at `batch` with speculation (module docstring), from `plain_ms`, the step without it."""
    from lmc.planner.latency import active_decode_parameters, decode_compute, efficiency_for, rank_tflops
    from lmc.planner.memory import compute_dtype
    from lmc.planner.steps import StepLayout, step_times

    spec = model.speculative
    assert spec is not None
    k = spec.num_tokens
    act = compute_dtype(dtype, model, hardware)
    efficiency = efficiency_for(engine, model, hardware, dtype)
    extra_flops = 2 * active_decode_parameters(model) / tp * k * batch
    verify = plain_ms + extra_flops / (rank_tflops(hardware, act, tp, dp) * 1e12 * decode_compute(efficiency)) * 1e3
    if spec.method == "ngram":
        draft = 0.0
    elif spec.method == "mtp":
        draft = k * plain_ms * model.mtp_layers / model.layers
    else:
        assert spec.draft is not None  # its step from the same choice of step times as the base's
        draft_steps = step_times(spec.draft, hardware, engine, StepLayout(engine.name, dtype, act, tp))
        draft = k * draft_steps.decode_ms(batch, input_tokens + output_tokens // 2)
    return (verify + draft) / tokens_per_step(spec)


def decode_ms(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int, batch: int,
              input_tokens: int, output_tokens: int, dp: int, plain_ms: float) -> float:
    """The decode TPOT the plan predicts: with speculation where it pays at `batch`, else `plain_ms`."""
    if model.speculative is None:
        return plain_ms
    return min(plain_ms, speculative_tpot_ms(model, hardware, engine, dtype, tp, batch, input_tokens,
                                             output_tokens, dp, plain_ms))


def break_even_batch(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                     input_tokens: int, output_tokens: int, dp: int, limit: int,
                     plain_at: Callable[[int], float]) -> int | None:
    """The smallest batch (up to `limit`) at which speculation no longer shortens a step; None if it always does.
    `plain_at(batch)` is the step without speculation. A bisection: the gain shrinks as the batch grows (the
    verify's extra tokens turn a memory-bound step compute-bound), so a few step-time queries suffice."""

    def pays(batch: int) -> bool:
        plain = plain_at(batch)
        return speculative_tpot_ms(model, hardware, engine, dtype, tp, batch, input_tokens, output_tokens, dp,
                                   plain) < plain

    if pays(limit):
        return None
    low, high = 0, limit  # pays at `low` (or low = 0), not at `high`
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if pays(middle) else (low, middle)
    return high


def speculative_section(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                        running: int, max_num_seqs: int, input_tokens: int, output_tokens: int,
                        dp: int, plain_at: Callable[[int], float]) -> dict | None:
    """The plan's `speculative` section: what the plan decided (enabled or not) and the figures it rests on.
    `plain_at(batch)` is the decode step without speculation, from the same step times as the plan's TPOT."""
    spec = model.speculative
    if spec is None:
        return None
    plain = plain_at(running)
    with_spec = speculative_tpot_ms(model, hardware, engine, dtype, tp, running, input_tokens, output_tokens, dp,
                                    plain)
    return {
        "method": spec.method, "vllm_method": VLLM_METHOD[spec.method], "num_tokens": spec.num_tokens,
        "model": spec.draft_source, "enabled": with_spec < plain,
        "acceptance_rate": spec.acceptance_rate, "acceptance_source": spec.acceptance_source,
        "tokens_per_step": round(tokens_per_step(spec), 3),
        "draft_bytes_per_device": draft_bytes(model, engine, dtype, tp, hardware),
        "revision": None if spec.draft is None else spec.draft.revision,
        "batch": running, "tpot_ms_without": round(plain, 3), "tpot_ms_with": round(with_spec, 3),
        "stops_paying_at_batch": break_even_batch(model, hardware, engine, dtype, tp, input_tokens, output_tokens,
                                                  dp, BREAK_EVEN_SCAN, plain_at),
    }


def speculative_reason(section: dict) -> str:
    """The `speculative` decision's reason."""
    method = section["method"]
    head = (f"{method} proposing {section['num_tokens']} token(s) a step, acceptance {section['acceptance_rate']:g} "
            f"({section['acceptance_source']}): {section['tokens_per_step']:.2f} tokens per target step "
            f"(Leviathan et al. eq. 1); at the planned batch of {section['batch']} a plain decode step gives a "
            f"token every {section['tpot_ms_with']:.2f} ms with it, {section['tpot_ms_without']:.2f} ms without "
            f"(verify: the step plus the GEMMs of the proposed tokens; draft: {_draft_words(method)}; the plan's "
            f"TPOT adds the prompts' chunks that share the steps)")
    stops = section["stops_paying_at_batch"]
    where = (f"; it stops paying at a batch of {stops} sequences per replica" if stops is not None
             else f"; it pays at every batch up to {BREAK_EVEN_SCAN}")
    if section["enabled"]:
        return head + where + f"; the proposer's weights take {section['draft_bytes_per_device'] / 2**30:.2f} GiB per device"
    return head + where + ": turned off (the plan runs without --speculative-config; lower the concurrency per "\
        "replica below that to gain from it)"


def _draft_words(method: str) -> str:
    return {"ngram": "none, a lookup in the prompt on the host",
            "draft": "k steps of the draft model at the batch",
            "eagle3": "k steps of the EAGLE-3 head at the batch",
            "mtp": "k passes of the MTP layers, their share of a step"}[method]
