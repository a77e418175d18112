"""Scale: pipeline stages across instances, the instance count for a rate, autoscaling bounds."""

from __future__ import annotations

import math

import pytest

from lmc.errors import NoFeasiblePlanError, SpecValueError
from lmc.planner import catalog, plan_deployment
from lmc.planner.engines import engine_facts
from lmc.planner.latency import predict
from lmc.planner.memory import param_split
from lmc.planner.scale import hop_ms, stage_model
from lmc.schema.spec import Spec

P4D = catalog.hardware_facts("ml.p4d.24xlarge")
G5 = catalog.hardware_facts("ml.g5.12xlarge")
LLAMA_405B = catalog.model_facts("meta-llama/Llama-3.1-405B")
LLAMA_8B = catalog.model_facts("meta-llama/Llama-3.1-8B")


def spec(**sections) -> Spec:
    body = {"model": {"id": "x"}, "target": {"instance": "ml.p4d.24xlarge"}}
    body.update(sections)
    return Spec.model_validate(body)


def plan(s, model, hardware):
    return plan_deployment(s, model, hardware, spec_sha256="0" * 64, lmc_version="0.1.0")


def test_stage_model_holds_its_share_of_the_blocks_and_one_vocabulary_matrix():
    whole = param_split(LLAMA_405B)
    stage = stage_model(LLAMA_405B, 4)
    assert stage.layers == 32  # ceil(126 / 4)
    split = param_split(stage)
    assert split.lm_head == 0 and split.embedding == whole.embedding
    assert split.sharded == pytest.approx(whole.sharded * 32 / 126, rel=1e-9)
    assert stage_model(LLAMA_405B, 1) is LLAMA_405B


def hf_stages(s, model, hardware, pp: int) -> list:
    """The hf engine's pipeline layouts the search still models (for --explain's comparison) at `pp` stages."""
    from lmc.planner.search import enumerate_configs

    configs, _ = enumerate_configs(s, model, hardware, engine_facts(), (pp,))
    return [c for c in configs if c.engine == "hf" and c.fits]


def test_lmcs_retired_hf_pipeline_is_still_modelled_for_the_comparison():
    # lmc's own hf pipeline (a batch passes the stages in turn) was removed; its layouts are still predicted,
    # for the comparison `lmc plan --explain` shows. A spec that pins it is told why it cannot have it.
    s = spec(target={"instance": "ml.p4d.24xlarge", "instances": 4}, workload={"concurrency": 4},
             pin={"dtype": "bf16"})
    staged = [c for c in hf_stages(s, LLAMA_405B, P4D, 4) if c.tp == 8]
    assert staged
    # one instance holds a quarter of 811 GB at most: the model could not have fitted on one
    assert LLAMA_405B.parameters * 2 > P4D.devices * P4D.device_memory_bytes
    # The hand-overs over EFA are in the predicted TPOT: the single-instance figure plus (pp - 1) hops.
    engine = engine_facts()["hf"]
    for c in staged:
        one = predict(LLAMA_405B, P4D, engine, "bf16", 8, 1, c.batch, 1024, 256)
        hop = hop_ms(P4D.network, c.batch * LLAMA_405B.hidden_size * 2)
        assert c.timing.tpot_ms == pytest.approx(one.tpot_ms + 3 * hop, abs=0.01)
        assert c.timing.cost_per_hour == pytest.approx(P4D.price_per_hour * 4 * c.replicas)
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(spec(target={"instance": "ml.p4d.24xlarge", "instances": 4}, workload={"concurrency": 4},
                  pin={"engine": "hf"}), LLAMA_405B, P4D)
    assert str(err.value).startswith("meta-llama/Llama-3.1-405B fits across instances only as the hf engine's "
                                     "pipeline stages")
    assert str(err.value).endswith("lmc's own hf pipeline was removed: vLLM's multi-node engine runs every model it "
                                   "could split (Llama) across instances, on GPUs and CPUs")
    assert 'pin.engine = "vllm"' in err.value.details[0]


def test_without_room_for_stages_the_405b_has_no_plan_and_is_told_how_many_instances_would_do():
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(spec(), LLAMA_405B, P4D)
    across = [line for line in err.value.details if line.startswith("target.instances = ")]
    # vLLM's fp8, weight-only on the A100s (Marlin), halves the weights: two instances hold them
    assert len(across) == 1 and across[0].startswith("target.instances = 2: vllm fp8 in 2 pipeline stages × TP 8 fits")
    # and that option is what planning with two instances gives
    two = plan(spec(target={"instance": "ml.p4d.24xlarge", "instances": 2}), LLAMA_405B, P4D)
    assert (two.engine, two.deployment.pipeline_parallel_degree, two.dtype) == ("vllm", 2, "fp8")


def test_a_model_that_fits_one_instance_stays_on_one_unless_pinned():
    s = spec(target={"instance": "ml.p4d.24xlarge", "instances": 2})
    assert plan(s, LLAMA_8B, P4D).deployment.pipeline_parallel_degree == 1
    pinned = spec(target={"instance": "ml.p4d.24xlarge", "instances": 2},
                  pin={"engine": "vllm", "pipeline_parallel_degree": 2})
    p = plan(pinned, LLAMA_8B, P4D)
    assert (p.deployment.pipeline_parallel_degree, p.deployment.instances) == (2, 2)
    assert p.decision("pipeline_parallel_degree").reason.startswith("pinned by the spec")


def test_pipeline_pin_beyond_the_instances_or_the_engine():
    with pytest.raises(SpecValueError) as err:
        plan(spec(pin={"pipeline_parallel_degree": 2}), LLAMA_8B, P4D)
    assert str(err.value) == ("pin.pipeline_parallel_degree = 2: 2 stages run on 2 instances; target.instances = 1: "
                              "raise target.instances to at least 2")
    with pytest.raises(SpecValueError, match="deepspeed cannot split llama into pipeline stages"):
        plan(spec(target={"instance": "ml.p4d.24xlarge", "instances": 2},
                  pin={"engine": "deepspeed", "pipeline_parallel_degree": 2}), LLAMA_8B, P4D)


def test_the_rate_sets_the_instance_count_and_the_peak_the_upper_bound():
    s = spec(target={"instance": "ml.g5.12xlarge", "instances": 40},
             workload={"concurrency": 4, "requests_per_second": 2.0, "peak_requests_per_second": 6.0})
    p = plan(s, LLAMA_8B, G5)
    d, t = p.deployment, p.predicted
    per_instance = 4 // p.tensor_parallel_degree
    per_replica = p.batch_size / ((t.ttft_ms + 256 * t.tpot_ms) / 1e3)
    assert d.instances == math.ceil(math.ceil(2.0 / per_replica - 1e-9) / per_instance)
    assert d.min_instances == d.instances
    assert d.max_instances == math.ceil(math.ceil(6.0 / per_replica - 1e-9) / per_instance)
    assert d.max_instances > d.min_instances
    assert d.requests_per_second >= 2.0
    assert d.cost_per_million_tokens_at_rate == pytest.approx(t.cost_per_hour / (2.0 * 256 * 3600) * 1e6, rel=1e-3)


@pytest.mark.parametrize("output_tokens", [256, 32768])
def test_the_request_rate_carries_the_throughput_at_any_generation_length(output_tokens):
    """requests/s × output tokens = throughput (issue 31), also where a long generation puts the rate under 0.01:
    rounded to 3 decimals, 0.00252 requests/s showed as 0.003, 19 % over the throughput it carries (found by
    the invariant sweep at 8192 + 32768 tokens)."""
    s = spec(target={"instance": "ml.g6e.xlarge"}, workload={"max_input_tokens": 8192, "max_output_tokens": output_tokens,
                                                              "concurrency": 4})
    p = plan(s, catalog.model_facts("bigscience/bloom-7b1"), catalog.hardware_facts("ml.g6e.xlarge"))
    rate, throughput = p.deployment.requests_per_second, p.predicted.throughput_tokens_per_s
    assert rate * output_tokens == pytest.approx(throughput, rel=0.01)
    if output_tokens == 32768:
        assert rate < 0.01 and len(f"{rate:g}".rstrip("0").split(".")[1].lstrip("0")) == 3  # 3 significant digits
        # --explain says the same figure (it said "0.00 requests/s")
        instances = next(d for d in p.decisions if d.key == "instances")
        assert f"they carry {rate:g} requests/s" in instances.reason


def test_an_impossible_rate_has_no_plan_and_says_why():
    s = spec(target={"instance": "ml.g5.12xlarge", "instances": 2},
             workload={"concurrency": 4, "requests_per_second": 500.0})
    with pytest.raises(NoFeasiblePlanError) as err:
        plan(s, LLAMA_8B, G5)
    assert str(err.value).startswith("requests_per_second = 500 needs ")
    assert str(err.value).endswith("instances of ml.g5.12xlarge at best; target.instances = 2 allows 2")
    assert "raise target.instances to" in err.value.details[0]


def test_peak_below_the_rate_is_a_spec_error():
    with pytest.raises(ValueError, match="the peak is the higher rate"):
        spec(workload={"requests_per_second": 5.0, "peak_requests_per_second": 2.0})


def test_one_stage_keeps_the_engines_own_prediction():
    """With one stage the engine's figures stand as predicted (vLLM's throughput pays its prefills,
    which batch / TPOT would not); only the rate's bounds are added."""
    from lmc.planner.latency import Timing
    from lmc.planner.scale import scale_timing

    engine = engine_facts()["hf"]
    timing = Timing(ttft_ms=100.0, tpot_ms=10.0, throughput_tokens_per_s=123.0, load_seconds=50.0,
                    cost_per_hour=7.09, cost_per_million_tokens=16.0, instances_used=1)
    scaled = scale_timing(timing, LLAMA_8B, G5, engine, "bf16", 4, 1, 1, 4, 1024, 100, peak_rate=2.0)
    assert scaled.timing is timing
    assert scaled.requests_per_second == pytest.approx(123.0 / 100)  # throughput / output tokens
    assert scaled.peak_instances == 2  # 2 requests/s need 2 replicas of 1.23, one per instance at TP 4 on 4 GPUs
    across = scale_timing(timing, LLAMA_8B, G5, engine, "bf16", 4, 2, 1, 4, 1024, 100)
    assert across.timing.throughput_tokens_per_s == pytest.approx(4 / across.timing.tpot_ms * 1e3)
    assert across.timing.instances_used == 2 and across.timing.load_seconds == 25.0


def test_vllm_across_instances_keeps_a_micro_batch_per_stage_in_flight():
    # vLLM's pipeline: pp micro-batches in flight, so a token's time is the whole model's step for its
    # micro-batch plus the hand-overs, and throughput is every micro-batch's sequences over it; lmc's hf
    # pipeline passed one batch through the stages in turn.
    from lmc.planner.vllm import vllm_predict

    s = spec(target={"instance": "ml.p4d.24xlarge", "instances": 4}, workload={"concurrency": 32},
             pin={"engine": "vllm", "dtype": "bf16"})
    p = plan(s, LLAMA_405B, P4D)
    pp, tp = p.deployment.pipeline_parallel_degree, p.tensor_parallel_degree
    assert (pp, tp, p.engine) == (4, 8, "vllm")
    # max_num_seqs caps vLLM's running requests over all the micro-batches together (its scheduler keeps one
    # running list), and the admission bound counts those, not max_num_seqs per stage
    running = min(p.vllm.max_num_seqs, 32)
    micro = -(-running // pp)
    admission = p.decision("admission").reason
    assert f"{running} running + " in admission and f"{running * pp} running" not in admission
    assert p.vllm.max_num_queued_reqs == running + p.job_queue_size
    engine = engine_facts()["vllm"]
    from lmc.planner.search import vllm_memory  # the layout the plan chose
    from lmc.planner.scale import stage_model

    _, layout = vllm_memory(stage_model(LLAMA_405B, pp), P4D, engine, engine.efficiency["gpu"], "bf16", tp,
                            p.vllm.max_num_seqs, 1024, 256, 0.9, None)
    whole = vllm_predict(LLAMA_405B, P4D, engine, "bf16", tp, 1, layout, 1024, 256, micro)
    hops = (pp - 1) * hop_ms(P4D.network, micro * LLAMA_405B.hidden_size * 2)
    assert p.predicted.tpot_ms == pytest.approx(whole.tpot_ms + hops, abs=0.01)
    mean_step = micro / whole.throughput_tokens_per_s * 1e3 + hops
    assert p.predicted.throughput_tokens_per_s == pytest.approx(running / mean_step * 1e3, rel=1e-3)
    hf = hf_stages(s.model_copy(update={"pin": s.pin.model_copy(update={"engine": None})}), LLAMA_405B, P4D, 4)
    assert hf and p.predicted.throughput_tokens_per_s > 2 * max(c.timing.throughput_tokens_per_s for c in hf)


def test_lmcs_retired_pipeline_is_shown_rejected_beside_vllms_layouts():
    # the 405B across four p4d: vLLM's multi-node layouts; lmc's hf pipeline is shown rejected, with its figures
    from lmc.planner.search import PIPELINE_RETIRED, enumerate_configs, retire_lmc_pipeline

    s = spec(target={"instance": "ml.p4d.24xlarge", "instances": 4}, workload={"concurrency": 4})
    p = plan(s, LLAMA_405B, P4D)
    assert (p.engine, p.deployment.pipeline_parallel_degree) == ("vllm", 4)
    hf = [a for a in p.alternatives if a.engine == "hf"]
    assert hf and not [a for a in hf if a.verdict == "feasible"]
    kept = [a for a in hf if a.reason.startswith(PIPELINE_RETIRED)]
    assert kept and all("pipeline stages" in a.reason and "TPOT" in a.reason for a in kept)
    bf16 = next(a for a in kept if a.dtype == "bf16" and a.tensor_parallel_degree == 8)
    figures = {f"TPOT {c.timing.tpot_ms:.2f} ms" for c in hf_stages(s, LLAMA_405B, P4D, 4)
               if c.dtype == "bf16" and c.tp == 8}
    assert any(f in bf16.reason for f in figures)  # the figures of a layout it would have been
    # every fitting staged layout of another engine is retired, whether or not a vLLM layout fits
    configs, _ = enumerate_configs(s, LLAMA_405B, P4D, engine_facts(), range(2, 5))
    staged_hf = [c for c in configs if c.engine == "hf" and c.fits]
    retired = retire_lmc_pipeline(staged_hf)
    assert retired and all(c.superseded == PIPELINE_RETIRED and not c.feasible for c in retired)


def test_a_configuration_the_rate_rules_out_is_an_alternative_that_says_so():
    # One fits and carries the rate on one instance; others fit but the rate needs more instances than the target
    # allows: the alternatives name that, with no cost cap in the spec (a fitting one left out was once always
    # called 'over max cost', which crashed formatting the absent cap).
    p5 = catalog.hardware_facts("ml.p5.48xlarge")
    qwen = catalog.model_facts("Qwen/Qwen3-8B")
    p = plan(spec(target={"instance": "ml.p5.48xlarge"}, workload={"max_input_tokens": 512, "max_output_tokens": 128,
                                                                   "requests_per_second": 5.0}), qwen, p5)
    assert p.deployment.requests_per_second >= 5.0
    ruled_out = [a for a in p.alternatives if "the request rate needs" in a.reason]
    assert ruled_out and all(a.verdict == "rejected" and a.reason.endswith("> target.instances = 1")
                             for a in ruled_out)
    assert not [a for a in p.alternatives if "over max cost" in a.reason]
