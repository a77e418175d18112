"""What a serving benchmark reports for a finite run, from the vLLM serving model's step times.

A plan's figures (planner/vllm.py `vllm_predict`) are the steady state: requests arriving as others leave.
A benchmark client measures something else. `vllm bench serve` and SGLang's `bench_serving` with
`--request-rate inf --max-concurrency C --num-prompts N` send the first C requests at once (a semaphore of C
around requests issued with no delay: vllm/benchmarks/serve.py `benchmark`, `limited_request_func`), then one
new request each time one finishes, until N are done. They report

- TTFT and TPOT per request, TPOT = (end-to-end − TTFT) / (output − 1), as the mean and median over the N
  requests, and ITL (every gap between two tokens) as mean and median over all gaps;
- output throughput = all output tokens / the run's duration, from the first request sent to the last answered.

So a run has a start that the steady state has not: C prompts arriving together into an idle engine. vLLM's
scheduler (vllm/v1/core/sched/scheduler.py `schedule`) serves the running requests' decodes first, then the
waiting prompts in arrival order, each taking what is left of the step's `max_num_batched_tokens` (chunked
prefill); a prompt's first token is sampled in the step that reads its last token. The burst is simulated
step by step below with the layout's step times: prompt k's TTFT is the end of the step that finishes it, and
its first decode steps are the burst's remaining (mixed) steps, then decodes of the whole burst with no new
prompts (in a closed loop nobody arrives until someone leaves), until the first request of the burst finishes;
from then on, arrivals follow departures one for one, staggered as the burst's first tokens were, and every
later request sees the steady state (`vllm_predict`'s TTFT and mean step).

The run's duration is the schedule the closed-loop client makes: the burst's requests start the slots
(slots = min(C, max_num_seqs)), each later request takes the first slot that frees and lasts the steady cycle,
TTFT + (output − 1) steps; once the last request is sent, no prompt joins any more, and the slots still busy
drain with plain decode steps of as many sequences as remain.

Output lengths drawn at random. Both clients' random datasets can draw each request's output length from a
range instead of fixing it (SGLang's `--random-range-ratio r`: uniform integers in [max(r·L, 1), L], r = 0
by default; vLLM's: [L(1 − r), L(1 + r)], r = 0 by default, so fixed). Then the slots do not finish together:
the run lasts until its slowest slot has served its requests, and a slot that drew long answers ends well
after the mean. With a range (`output_range`), the schedule above runs with lengths that are the range's
quantiles, scaled to the run's mean, in a shuffled order, averaged over 8 fixed shuffles, so the figure is
deterministic; the other figures take the mean length.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass

from lmc.planner.facts import EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.steps import StepTimes, prefix_attention_ms
from lmc.planner.vllm import VllmLayout, decode_context, layout_steps, running_sequences, vllm_predict


@dataclass(frozen=True)
class BenchmarkRun:
    """A closed-loop run's figures as the benchmark clients report them (module docstring)."""

    mean_ttft_ms: float
    median_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    median_itl_ms: float
    throughput_tokens_per_s: float  # output tokens over the run's duration
    duration_s: float


@dataclass(frozen=True)
class Burst:
    """The first C prompts, arriving together: per prompt, the step (index) that gives its first token and that
    step's end (ms from the start); and every burst step's duration."""

    first_step: list[int]
    first_token_ms: list[float]
    step_ms: list[float]


def burst(steps: StepTimes, prompts: int, input_tokens: int, budget: int, cached: int = 0) -> Burst:
    """`prompts` prompts of `input_tokens` each, arriving together into an idle engine: each step carries the
    decodes of the prompts already answered (one token each, scheduled first), then the next prompt tokens in
    arrival order up to the step's token budget, a prompt's chunk after its first with its attention over the
    prompt's earlier tokens (steps.prefix_attention_ms). The first `cached` prompts are in the engine's prefix cache:
    each costs the one token vLLM computes even on a full hit (the last, to sample from)."""
    first_step, first_token, durations = [], [], []
    ends, total = [], 0  # where each prompt's tokens end in the arrival-ordered stream
    for k in range(prompts):
        total += 1 if k < cached else input_tokens
        ends.append(total)
    done, consumed, clock = 0, 0, 0.0  # prompts answered; prompt tokens read so far
    while done < prompts:
        chunk = min(max(budget - done, 1), total - consumed)
        ms = steps.mixed_ms(chunk, done, input_tokens, input_tokens + 1) if done else steps.prefill_ms(chunk)
        ms += _prefix_attention_in(steps, ends, consumed, chunk)
        consumed += chunk
        clock += ms
        durations.append(ms)
        while done < prompts and ends[done] <= consumed:
            first_step.append(len(durations) - 1)
            first_token.append(clock)
            done += 1
    return Burst(first_step, first_token, durations)


def _prefix_attention_in(steps: StepTimes, ends: list[int], consumed: int, chunk: int) -> float:
    """The attention a step's `chunk` tokens (from `consumed` on in the prompts' stream; `ends`: where each
    prompt ends in it) spend on the earlier tokens of their own prompts (steps.prefix_attention_ms): a
    prompt's chunk after its first."""
    extra, start = 0.0, 0
    for end in ends:
        low, high = max(consumed, start), min(consumed + chunk, end)
        if low < high and low > start:
            extra += prefix_attention_ms(steps, low - start, high - low)
        if end >= consumed + chunk:
            break
        start = end
    return extra


def vllm_benchmark_run(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                       replicas: int, layout: VllmLayout, input_tokens: int, output_tokens: int, concurrency: int,
                       prompts: int, steps: StepTimes | None = None, cached: int = 0,
                       output_range: tuple[int, int] | None = None) -> BenchmarkRun:
    """`prompts` requests at most `concurrency` at a time, the first `concurrency` sent together (module
    docstring), over `replicas` replicas of `layout`: the figures a benchmark client reports. `cached`: how many
    of the run's first prompts the engine has already seen (module docstring, "Prompts already cached").
    `output_range`: the (lowest, highest) output length the client draws uniformly, `output_tokens` their mean
    (module docstring, "Output lengths drawn at random"); None for fixed lengths."""
    dp = layout.data_parallel_size
    groups = replicas * dp
    if steps is None:
        steps = layout_steps(model, hardware, engine, dtype, tp, layout)
    steady = vllm_predict(model, hardware, engine, dtype, tp, replicas, layout, input_tokens, output_tokens,
                          concurrency, steps)
    # Requests spread evenly over the groups that have any: fewer clients than groups leave the rest empty, and
    # the run's prompts go to the busy ones.
    busy = max(1, min(groups, concurrency))
    clients = max(1, min(-(-concurrency // busy), -(-prompts // busy)))  # per busy group
    per_group = prompts / busy
    running = running_sequences(layout.max_num_seqs, 1, clients)
    efficiency = engine.efficiency[hardware.kind]
    server = steps.server_ms(efficiency, input_tokens)
    context = decode_context(input_tokens, output_tokens)
    gaps = output_tokens - 1

    cached_per_group = cached / busy
    wave = burst(steps, running, input_tokens, layout.max_num_batched_tokens, math.floor(cached_per_group))
    # After the burst: decodes of the whole burst until its first request leaves (step first_step[0] + gaps),
    # then the steady state's mean step.
    full = steps.decode_ms(running, context)
    steady_from = wave.first_step[0] + gaps
    ttfts, tpots, itls = [], [], []  # (value, weight): per request; per gap
    burst_ends = []  # per burst request: (when its first token came, its mean step after it)
    for k, step_k in enumerate(wave.first_step):
        last = step_k + gaps  # the step that gives its last token
        in_burst = wave.step_ms[step_k + 1: last + 1]
        decoding = max(min(last, steady_from) - max(step_k, len(wave.step_ms) - 1), 0)
        at_steady = gaps - len(in_burst) - decoding
        decode_ms = sum(in_burst) + decoding * full + at_steady * steady.tpot_ms
        tpot = decode_ms / gaps if gaps else 0.0
        ttfts.append((server + wave.first_token_ms[k], 1))
        burst_ends.append((server + wave.first_token_ms[k], tpot))
        tpots.append((tpot, 1))
        itls += [(ms, 1) for ms in in_burst] + [(full, decoding), (steady.tpot_ms, at_steady)]
    later = max(per_group - running, 0.0)  # the group's requests after the burst: the steady state's
    hits = min(max(cached_per_group - running, 0.0), later)  # ... but cached: half a step's wait and one step
    ttfts += [(steady.ttft_ms, later - hits), (server + 1.5 * steady.tpot_ms, hits)]
    tpots.append((steady.tpot_ms, later))
    itls.append((steady_itl_ms(steps, layout, running, input_tokens, output_tokens, context, steady.tpot_ms),
                 later * gaps))

    # The run lasts the client's schedule over the burst's slots (the module docstring). With more clients
    # than slots the slots are the chains (the extra clients wait for one), so `running` of them share the requests.
    spread = output_range if output_range is not None and output_range[0] < output_range[1] else None
    duration = statistics.fmean(
        list_schedule_ms(burst_ends, max(round(per_group), len(burst_ends)), spread or (output_tokens, output_tokens),
                         output_tokens, steady.own_ttft_ms, steady.tpot_ms,
                         lambda batch: steps.decode_ms(batch, context), seed)
        for seed in range(8 if spread else 1))
    return BenchmarkRun(mean_ttft_ms=_mean(ttfts), median_ttft_ms=_median(ttfts), mean_tpot_ms=_mean(tpots),
                        median_tpot_ms=_median(tpots), median_itl_ms=_median(itls),
                        throughput_tokens_per_s=prompts * output_tokens / duration * 1e3, duration_s=duration / 1e3)


def list_schedule_ms(burst: list[tuple[float, float]], requests: int, output_range: tuple[int, int], mean: float,
                     ttft_ms: float, step_ms: float, decode_ms, seed: int) -> float:
    """When a closed-loop run of `requests` whose output lengths spread over `output_range` ends: the burst's
    requests (`burst`: when each one's first token came and its mean step after) start the slots; each later
    request takes the first slot that frees, for `ttft_ms` and (length − 1) steps of `step_ms`; after the last
    one is sent, the slots still busy finish their tokens at decode steps of as many as remain (`decode_ms`).
    The lengths are the range's quantiles scaled to the run's `mean` (what the run's totals say it drew)."""
    low, high = output_range
    lengths = [low + (high - low) * (i + 0.5) / requests for i in range(requests)]
    scale = mean / statistics.fmean(lengths)
    lengths = [max(length * scale, 1.0) for length in lengths]
    random.Random(seed).shuffle(lengths)
    slots = [first + (lengths[k] - 1) * step for k, (first, step) in enumerate(burst[:requests])]
    heapq.heapify(slots)
    if requests <= len(slots):  # the burst was the whole run
        return max(slots)
    for length in lengths[len(slots):]:
        now = heapq.heappop(slots)
        heapq.heappush(slots, now + ttft_ms + (length - 1) * step_ms)
    # The drain: the remaining tokens of each slot at `now`, stepped by decodes of the ones left.
    left = sorted(max(end - now, 0.0) / step_ms for end in slots)
    clock, done = now, 0.0
    for index, tokens in enumerate(left):
        clock += (tokens - done) * decode_ms(len(left) - index)
        done = tokens
    return clock


def steady_itl_ms(steps: StepTimes, layout: VllmLayout, running: int, input_tokens: int, output_tokens: int,
                  context: int, mean_step: float) -> float:
    """The median gap between two tokens in the steady state: a plain decode step when fewer than half the steps
    carry a prompt's chunk (each prompt takes ceil(input / budget) of them, `running` prompts per output_tokens
    steps), the mean step otherwise."""
    budget = max(layout.max_num_batched_tokens - running, 1)
    carrying = running / output_tokens * math.ceil(input_tokens / budget)
    return steps.decode_ms(running, context) if carrying < 0.5 else mean_step


def _mean(weighted: list[tuple[float, float]]) -> float:
    total = sum(w for _, w in weighted)
    return sum(v * w for v, w in weighted) / total if total else 0.0


def _median(weighted: list[tuple[float, float]]) -> float:
    """The weighted median (the lower one at an exact half)."""
    items = sorted((v, w) for v, w in weighted if w > 0)
    if not items:
        return 0.0
    half, seen = sum(w for _, w in items) / 2, 0.0
    for value, weight in items:
        seen += weight
        if seen >= half:
            return value
    return statistics.median(v for v, _ in items)
