"""Admission, the request rate and "goal met": one set of figures from the predicted TTFT, TPOT and
throughput. Pure math over the predictions (latency.py, vllm.py) and the spec; docs/goals-and-admission.md.

- Requests per second = throughput / output tokens per request (the workload's max_output_tokens):
  the figure `deployment.requests_per_second` shows, and what the instance count for a request rate and
  the autoscaling targets are sized from.
- Admission, per replica (one server: a vLLM engine with its data-parallel groups and pipeline
  micro-batches, or one of lmc's worker groups): `running` requests decode at once; a waiting request
  starts when running ones end. A replica frees one of its `running` slots every request time / running
  (continuous batching) or all of them every request time (dynamic batching: a batch runs to its longest
  request), a request time being TTFT + (output tokens − 1) × TPOT (its first token comes with the TTFT). A
  request behind `w` waiting ones sees its first token after the turns that free its slot, plus its own
  TTFT: the replica holds as many waiting
  as keep that within the TTFT goal (vLLM's max_num_queued_reqs − running; job_queue_size for lmc's
  engines), and answers 503 beyond. Without a TTFT goal: a queue of twice the replica's share of the
  concurrency, at least four batches.
- The goal is met when the workload's concurrency is admitted (its share per replica ≤ running +
  waiting) and meets the TPOT goal and the TTFT goal with its queueing: the last of the share to start
  has TTFT = its wait in the queue + its own TTFT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACCEPT_FLAG = "--accept-missed-goal"


def output_tokens_per_request(workload) -> int:
    """The output tokens one request of the workload produces: max_output_tokens (the spec has no mean)."""
    return workload.max_output_tokens


def requests_per_second(throughput_tokens_per_s: float, output_tokens: int) -> float:
    """The requests per second a predicted output throughput carries, `output_tokens` each
    (output_tokens_per_request)."""
    return throughput_tokens_per_s / output_tokens


def replicas_for_rate(rate: float, per_replica_rps: float) -> int:
    """Replicas that carry `rate` requests per second when each carries `per_replica_rps`."""
    return max(math.ceil(rate / per_replica_rps - 1e-9), 1)


@dataclass(frozen=True)
class Admission:
    """How many requests one replica holds at once (running + waiting) before it answers 503."""

    running: int  # requests one replica decodes at once
    waiting: int  # requests it holds waiting beyond them (job_queue_size per replica; ≥ 1)
    turn_ms: float  # how often a replica frees `per_turn` of its running slots
    per_turn: int  # 1 (continuous batching) or `running` (dynamic: a whole batch ends at once)
    ttft_ms: float  # a request's own TTFT, once it runs
    retry_after_s: int  # the Retry-After of the 503: about one turn
    reason: str

    @property
    def bound(self) -> int:
        """Requests one replica admits: running + waiting (vLLM's max_num_queued_reqs)."""
        return self.running + self.waiting

    def queued_ttft_ms(self, share: int) -> float:
        """TTFT of the last of `share` concurrent requests at one replica to start: the turns it waits for
        a slot, then its own TTFT."""
        behind = max(share - self.running, 0)
        return self.ttft_ms + math.ceil(behind / self.per_turn) * self.turn_ms


def admission(ttft_goal_ms: float | None, ttft_ms: float, tpot_ms: float, output_tokens: int, running: int,
              share: int, continuous: bool, busy: tuple[float, float] | None = None) -> Admission:
    """One replica's admission bound (module docstring): `running` decode at once, `share` of the
    workload's concurrency arrives at it; the waiting it may hold follows from the TTFT goal. `ttft_ms` and
    `tpot_ms` are the workload's; `busy`, (TTFT, TPOT) with every running slot taken, where that differs
    (fewer requests than slots): a request waits only then, so the turns are timed there."""
    own_ttft_ms = ttft_ms
    if busy is not None:
        ttft_ms, tpot_ms = busy
    gaps = max(output_tokens - 1, 0)  # the first token comes with the TTFT, as the throughput's cycle counts it
    request_ms = ttft_ms + gaps * tpot_ms
    per_turn = 1 if continuous else running
    turn_ms = request_ms / running if continuous else request_ms
    retry = max(1, math.ceil(turn_ms / 1000))
    frees = (f"one of {running} running requests ends every {turn_ms:.1f} ms" if continuous else
             f"a batch of {running} ends every {turn_ms:.0f} ms (dynamic batching: it runs to its longest request)")
    # Where the share queues, the predicted TTFT includes that wait; a slot's turn counts the TTFT once it runs.
    first = "TTFT" if share <= running else "TTFT once it runs"
    frees += (f" ({first} {ttft_ms:.1f} + {gaps} × TPOT {tpot_ms:.2f} = {request_ms:.0f} ms a request"
              + (f" with all {running} slots taken)" if busy is not None else ")"))
    if ttft_goal_ms is None:
        waiting = max(2 * share, 4 * running)
        return Admission(running, waiting, turn_ms, per_turn, own_ttft_ms, retry,
                         f"no TTFT goal: {running} running + {waiting} waiting (twice the replica's {share} "
                         f"concurrent requests, at least four batches); {frees}; one more is answered 503 with "
                         f"Retry-After {retry} s")
    turns = max(math.floor((ttft_goal_ms - ttft_ms) / turn_ms), 0)
    waiting = turns * per_turn
    kept = f"{waiting} waiting keep a waiting request's wait + TTFT within the {ttft_goal_ms:g} ms TTFT goal"
    if waiting < 1:  # a queue of none would refuse every request while a batch runs
        waiting = 1
        kept = (f"even one waiting request may miss the {ttft_goal_ms:g} ms TTFT goal (up to {turn_ms:.0f} ms for a "
                f"slot, then its TTFT {ttft_ms:.0f} ms); the queue holds 1 all the same, so a request that finds every "
                f"slot taken waits for one instead of being refused")
    return Admission(running, waiting, turn_ms, per_turn, own_ttft_ms, retry,
                     f"{frees}: {kept}; {running} running + {waiting} waiting = {running + waiting} "
                     f"admitted per replica, one more is answered 503 with Retry-After {retry} s")


@dataclass(frozen=True)
class GoalCheck:
    """The goal verdict of one configuration."""

    gap: float  # max over the goals of predicted / goal (≤ 1: met); concurrency / admitted when not admitted
    met: bool
    queued_ttft_ms: float  # TTFT of the last concurrent request to start, its queueing included
    admitted: int  # requests the plan admits at once (every replica)
    reason: str
    missed: str = ""  # the parts of `reason` that miss, for an alternative rejected by the goal


def goal_check(tpot_goal_ms: float | None, ttft_goal_ms: float | None, tpot_ms: float, concurrency: int,
               replicas: int, admitted: Admission) -> GoalCheck:
    """Whether the workload's concurrency is admitted and meets the TPOT and TTFT goals with its queueing."""
    share = math.ceil(concurrency / replicas)
    queued = admitted.queued_ttft_ms(share)
    total = admitted.bound * replicas
    gaps, parts, missed = [0.0], [], []
    if tpot_goal_ms is not None:
        gaps.append(tpot_ms / tpot_goal_ms)
        parts.append(f"TPOT {tpot_ms:.2f} ms {'≤' if tpot_ms <= tpot_goal_ms else '>'} {tpot_goal_ms:g} ms")
        missed += parts[-1:] if tpot_ms > tpot_goal_ms else []
    if ttft_goal_ms is not None:
        gaps.append(queued / ttft_goal_ms)
        waited = (f" (TTFT {admitted.ttft_ms:.2f} ms + the queue: {share - admitted.running} of {share} per replica "
                  "wait for a slot)" if share > admitted.running else "")
        parts.append(f"TTFT {queued:.2f} ms{waited} {'≤' if queued <= ttft_goal_ms else '>'} {ttft_goal_ms:g} ms")
        missed += ([f"TTFT {queued:.0f} ms{' with the queue' if waited else ''} > {ttft_goal_ms:g} ms"]
                   if queued > ttft_goal_ms else [])
    if share > admitted.bound:
        gaps.append(share / admitted.bound)
        parts.append(f"concurrency {concurrency} NOT admitted: {total} admitted ({replicas} replica(s) × "
                     f"({admitted.running} running + {admitted.waiting} waiting)); the rest are answered 503")
        missed.append(f"concurrency {concurrency} NOT admitted: {total} admitted")
    else:
        parts.append(f"concurrency {concurrency} admitted ({total} at once: {replicas} replica(s) × "
                     f"({admitted.running} running + {admitted.waiting} waiting))")
    gap = max(gaps)
    return GoalCheck(gap=gap, met=gap <= 1.0, queued_ttft_ms=queued, admitted=total, reason="; ".join(parts),
                     missed="; ".join(missed))


def goal_missed_line(plan) -> str:
    """One line for a plan that misses its goal: by how much, from the plan's goal decision."""
    decision = plan.decision("goal")
    return "the plan misses its goal: " + (decision.reason if decision is not None else "goal_met is false")


def refuse_missed_goal(plan, accepted: bool, command: str) -> None:
    """Raise GoalMissedError (exit 4) for a plan that misses its goal, unless `accepted` (--accept-missed-goal)."""
    if plan.goal_met or accepted:
        return
    from lmc.errors import GoalMissedError

    raise GoalMissedError(f"{goal_missed_line(plan)}; `lmc {command}` refuses it: change the spec, or pass "
                          f"{ACCEPT_FLAG} to {command} it anyway")
