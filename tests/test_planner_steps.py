"""Step times (lmc/planner/steps.py): one interface, two implementations, one place that chooses; the serving
model on top (planner/vllm.py); the fp8 KV cache as a planned choice."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lmc.errors import SpecValueError
from lmc.planner import catalog, latency, plan_deployment, steps
from lmc.planner.engines import engine_facts
from lmc.planner.latency import tpot_ms, ttft_ms
from lmc.planner.steps import MeasuredSteps, RooflineSteps, StepLayout, step_times
from lmc.planner.vllm import queued_ttft_ms, vllm_memory, vllm_predict
from lmc.schema.spec import Spec

ENGINES = engine_facts()
VLLM = ENGINES["vllm"]
QWEN8 = catalog.model_facts("Qwen/Qwen3-8B")
LLAMA70 = catalog.model_facts("meta-llama/Llama-3.1-70B")
H100 = catalog.hardware_facts("ml.p5.48xlarge")
A10G = catalog.hardware_facts("ml.g5.12xlarge")
BF16 = StepLayout("vllm", "bf16", "bf16", 1)


@pytest.fixture
def step_cache(tmp_path, monkeypatch):
    """An empty step-time cache under a fresh HF_HOME, and no layout remembered in this process."""
    pytest.importorskip("aiconfigurator_core")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HOME", str(tmp_path))
    monkeypatch.setattr(steps, "_MEASURED", {})
    return tmp_path


def plan(body: dict, model, hardware):
    return plan_deployment(Spec.model_validate({"model": {"id": model.id}, **body}), model, hardware,
                           spec_sha256="0" * 64, lmc_version="test")


def test_the_roofline_answers_with_latency_py_and_a_mixed_step_adds_the_chunk_beyond_a_one_token_pass():
    s = RooflineSteps(QWEN8, A10G, VLLM, BF16)
    assert s.decode_ms(8, 1500) == tpot_ms(QWEN8, A10G, VLLM, "bf16", 1, 8, 1500, 0)
    assert s.prefill_ms(1000) == ttft_ms(QWEN8, A10G, VLLM, "bf16", 1, 1000)
    assert s.mixed_ms(512, 8, 1000, 1500) == pytest.approx(s.decode_ms(8, 1500) + s.prefill_ms(512) - s.prefill_ms(1))
    # An fp8 KV cache halves the bytes a decode step reads from the cache: the step shrinks by half the KV term.
    fp8 = RooflineSteps(QWEN8, A10G, VLLM, StepLayout("vllm", "bf16", "fp8", 1))
    kv_bf16 = 8 * 1500 * 2 * QWEN8.layers * QWEN8.kv_heads * QWEN8.head_dim * 2  # bytes: batch · context · 2·L·kv·hd·b
    efficiency = VLLM.efficiency["gpu"]
    bandwidth = A10G.memory_bandwidth_bytes_per_s * efficiency.decode_bandwidth
    assert s.decode_ms(8, 1500) - fp8.decode_ms(8, 1500) == pytest.approx(kv_bf16 / 2 / bandwidth * 1e3, rel=1e-6)


def test_measured_steps_are_aiconfigurators_own_numbers():
    pytest.importorskip("aiconfigurator_core")
    from aiconfigurator_core.sdk.engine import EngineHandle

    s = step_times(QWEN8, H100, VLLM, BF16)
    assert isinstance(s, MeasuredSteps)
    assert s.source == "aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0)"
    sdk = EngineHandle.compile("Qwen/Qwen3-8B", "h100_sxm", "vllm", backend_version="0.24.0", tp_size=1,
                               gemm_quant_mode="bfloat16", moe_quant_mode="bfloat16")
    assert s.prefill_ms(2048) == pytest.approx(sdk.predict_prefill_latency(1, 2048), rel=1e-9)
    assert s.decode_ms(32, 1500) == pytest.approx(sdk.decode_step_latency(32, 1499, 1), rel=1e-9)
    assert s.mixed_ms(1024, 31, 1024, 1280) == pytest.approx(sdk.mixed_step_latency(1024, 31, 1024, 512), rel=1e-9)
    # Its data, not a datasheet: a bigger batch costs more, a longer prompt more still.
    assert s.decode_ms(64, 1500) > s.decode_ms(1, 1500) and s.prefill_ms(4096) > 1.8 * s.prefill_ms(2048)


def test_an_expert_parallel_plan_asks_for_whole_experts_per_rank():
    pytest.importorskip("aiconfigurator_core")
    from aiconfigurator_core.sdk.engine import EngineHandle

    qwen235 = catalog.model_facts("Qwen/Qwen3-235B-A22B")
    body = {"target": {"instance": "ml.p5.48xlarge"},
            "workload": {"max_input_tokens": 1024, "max_output_tokens": 1024, "concurrency": 16},
            "pin": {"engine": "vllm", "tensor_parallel_degree": 8, "dtype": "bf16", "replicas": 1}}
    split = plan(body, qwen235, H100)
    whole = plan({**body, "pin": {**body["pin"], "expert_parallel": True}}, qwen235, H100)
    assert whole.vllm.enable_expert_parallel and not split.vllm.enable_expert_parallel
    # vLLM --enable-expert-parallel at TP 8: each rank holds 16 whole experts (aiconfigurator's moe_ep_size 8),
    # without it every expert is split 8 ways (moe_tp_size 8): different kernels, different step times.
    args = {"backend_version": "0.24.0", "tp_size": 8, "gemm_quant_mode": "bfloat16", "moe_quant_mode": "bfloat16"}
    for p, moe in ((split, {"moe_tp_size": 8, "moe_ep_size": 1}), (whole, {"moe_tp_size": 1, "moe_ep_size": 8})):
        sdk = EngineHandle.compile("Qwen/Qwen3-235B-A22B", "h100_sxm", "vllm", **args, **moe)
        s = step_times(qwen235, H100, VLLM, StepLayout("vllm", "bf16", "bf16", 8, 1, p.vllm.enable_expert_parallel))
        assert s.decode_ms(16, 1536) == pytest.approx(sdk.decode_step_latency(16, 1535, 1), rel=1e-9)
    assert whole.predicted.tpot_ms != split.predicted.tpot_ms


def test_a_requests_own_overhead_is_aiconfigurators_where_its_data_answer():
    # Its kernel data leave out the CPU's dispatch and the server; its vLLM backend adds, to every TTFT, an overhead
    # calibrated against its measured serving runs, which lmc takes instead of engines.toml's fixed 8 ms.
    pytest.importorskip("aiconfigurator_core")
    from aiconfigurator_core.sdk.backends.vllm_backend import VLLMBackend

    efficiency = VLLM.efficiency["gpu"]
    measured = step_times(LLAMA70, H100, VLLM, StepLayout("vllm", "bf16", "bf16", 8))
    assert isinstance(measured, MeasuredSteps)

    class Model:  # what its method reads
        _num_layers = LLAMA70.layers

    theirs = VLLMBackend()._prefill_dispatch_overhead_ms(Model())
    assert theirs > 4 * efficiency.request_overhead_ms  # 80 layers: 64 ms against 8
    for layers in (24, 61, 94):  # lmc's copy of the term (planning never imports aiconfigurator's backends)
        Model._num_layers = layers
        assert steps._dispatch_overhead_ms("vllm", layers) == pytest.approx(
            VLLMBackend()._prefill_dispatch_overhead_ms(Model()))
    Model._num_layers = LLAMA70.layers
    assert measured.server_ms(efficiency, 1000) == pytest.approx(theirs + efficiency.tokenize_us_per_token * 1e-3 * 1000)
    own = RooflineSteps(LLAMA70, A10G, VLLM, BF16)
    assert own.server_ms(efficiency, 1000) == pytest.approx(efficiency.request_overhead_ms
                                                            + efficiency.tokenize_us_per_token * 1e-3 * 1000)
    # The plan's TTFT at one request: that overhead, then the prompt's prefill.
    p = plan({"target": {"instance": "ml.p5.48xlarge"}, "workload": {"max_input_tokens": 1000, "max_output_tokens": 100,
                                                                   "concurrency": 1},
              "pin": {"engine": "vllm", "tensor_parallel_degree": 8, "dtype": "bf16", "replicas": 1}}, LLAMA70, H100)
    assert p.predicted.ttft_ms == pytest.approx(measured.server_ms(efficiency, 1000) + measured.prefill_ms(1000), abs=0.01)


def test_a_second_plan_reads_the_step_times_from_disk_without_aiconfigurator(step_cache, monkeypatch):
    tmp_path = step_cache
    first = step_times(QWEN8, H100, VLLM, StepLayout("vllm", "bf16", "bf16", 2))
    answer = first.decode_ms(16, 3000)
    steps.save_step_times()  # what pipeline.plan_from_spec does after planning
    cached = list((tmp_path / "lmc" / "step_times" / "h100_sxm--vllm").glob("*.json"))
    assert len(cached) == 1 and '"d16,2999"' in cached[0].read_text()
    monkeypatch.setattr(steps, "_MEASURED", {})  # a new process
    monkeypatch.setattr(steps, "_compile", lambda *args: pytest.fail("compiled although the answer was cached"))
    second = step_times(QWEN8, H100, VLLM, StepLayout("vllm", "bf16", "bf16", 2))
    assert second is not first and second.decode_ms(16, 3000) == answer


@pytest.mark.parametrize(("instance", "engine", "why"), [
    ("ml.g5.12xlarge", "vllm", "aiconfigurator has no data for a10g"),
    ("local", "vllm", "aiconfigurator has no data for cpu"),
    ("ml.inf2.24xlarge", "neuronx", "aiconfigurator has no data for lmc's neuronx engine"),
    ("ml.p5.48xlarge", "hf", "aiconfigurator has no data for lmc's hf engine"),
])
def test_where_aiconfigurator_has_no_data_lmcs_model_answers_and_says_why(instance, engine, why):
    hardware = catalog.hardware_facts(instance)
    s = step_times(QWEN8, hardware, ENGINES[engine], StepLayout(engine, "bf16", "bf16", 1))
    assert isinstance(s, RooflineSteps)
    assert s.source == f"lmc roofline (latency.py); {why}"


def test_the_plan_names_the_model_behind_its_figures(monkeypatch):
    body = {"target": {"instance": "ml.g5.12xlarge"}, "pin": {"engine": "vllm"}}
    assert plan(body, QWEN8, A10G).predicted.step_times == "lmc roofline (latency.py); aiconfigurator has no data for a10g"
    measured = plan({"target": {"instance": "ml.p5.48xlarge"}}, QWEN8, H100).predicted.step_times
    assert measured == "aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0)"
    monkeypatch.setenv("LMC_STEP_TIMES", "lmc")
    assert plan({"target": {"instance": "ml.p5.48xlarge"}}, QWEN8, H100).predicted.step_times == (
        "lmc roofline (latency.py); LMC_STEP_TIMES=lmc")


def test_an_alternative_on_another_step_time_model_than_the_plan_says_which():
    # The plan is stepped on measured data; an fp32 alternative has none (lmc's own model): its figures say so,
    # the alternatives on the same data as the plan do not repeat it.
    pytest.importorskip("aiconfigurator_core")
    p = plan({"target": {"instance": "ml.p5.48xlarge"}}, QWEN8, H100)
    assert p.predicted.step_times.startswith("aiconfigurator-core")
    feasible = [a for a in p.alternatives if a.verdict == "feasible"]
    fp32 = [a for a in feasible if a.dtype == "fp32"]
    assert fp32 and all(a.reason.endswith("; step times: lmc roofline (latency.py); aiconfigurator has no fp32 data "
                                          "for vLLM") for a in fp32)
    assert all("step times" not in a.reason for a in feasible if a.dtype != "fp32")


def test_queueing_past_the_running_slots_follows_littles_law():
    # 8 clients on 4 slots: each round trip is 8/4 of a slot's (TTFT 100 + 10 more tokens at 10 ms = 200 ms),
    # 400 ms, of which 100 ms decode: 300 ms to the first token.
    assert queued_ttft_ms(100.0, 10.0, 4, 8, 11) == pytest.approx(300.0)
    assert queued_ttft_ms(100.0, 10.0, 4, 4, 11) == pytest.approx(100.0)


def test_past_the_pool_a_plan_is_a_saturated_system_with_queueing_not_a_refusal():
    body = {"target": {"instance": "ml.p5.48xlarge"}, "pin": {"engine": "vllm", "tensor_parallel_degree": 8,
                                                              "kv_cache_dtype": "auto", "replicas": 1, "dtype": "bf16"},
            "workload": {"max_input_tokens": 16000, "max_output_tokens": 2000, "concurrency": 400}}
    p = plan(body, LLAMA70, H100)
    # what the pool runs on demand: sequences at the mean length, 16000 + 1000 tokens (vLLM allocates blocks as
    # they grow), more than the 18000-token sequences it could hold at once
    held = p.kv_cache.blocks // -(-17000 // 16)
    assert p.batch_size == held < 400 and held > p.kv_cache.max_concurrent_sequences
    assert p.vllm.max_num_queued_reqs is None or p.vllm.max_num_queued_reqs >= held
    # The serving model at the pool's batch: the same steps for the held sequences as for 400 clients, the
    # rest of whom wait their turn.
    _, layout = vllm_memory(LLAMA70, H100, VLLM, VLLM.efficiency["gpu"], "bf16", 8, held, 16000, 2000, 0.9, None)
    within = vllm_predict(LLAMA70, H100, VLLM, "bf16", 8, 1, layout, 16000, 2000, held)
    past = vllm_predict(LLAMA70, H100, VLLM, "bf16", 8, 1, layout, 16000, 2000, 400)
    assert past.tpot_ms == within.tpot_ms and past.throughput_tokens_per_s == within.throughput_tokens_per_s
    cycle = within.ttft_ms + 1999 * within.tpot_ms
    assert past.ttft_ms == pytest.approx(400 / held * cycle - 1999 * within.tpot_ms)
    assert p.predicted.ttft_ms == pytest.approx(past.ttft_ms, rel=1e-4)


def test_fp8_kv_cache_is_planned_where_the_pool_decides_the_concurrency():
    from lmc.emitters.render import render_text_files
    from lmc.runtime.vllm_backend import engine_arguments

    body = {"target": {"instance": "ml.p5.48xlarge"}, "pin": {"engine": "vllm", "tensor_parallel_degree": 8},
            "workload": {"max_input_tokens": 16000, "max_output_tokens": 2000, "concurrency": 256}}
    p = plan(body, LLAMA70, H100)
    auto = plan({**body, "pin": {**body["pin"], "kv_cache_dtype": "auto"}}, LLAMA70, H100)
    runs = {name: q.kv_cache.blocks // -(-17000 // 16) for name, q in (("fp8", p), ("auto", auto))}  # on demand
    assert auto.vllm.kv_cache_dtype == "auto" and auto.batch_size == runs["auto"] < 256
    assert p.vllm.kv_cache_dtype == "fp8"
    assert runs["fp8"] >= 2 * runs["auto"] - 1
    reason = p.decision("kv_cache_dtype").reason
    assert f"runs {runs['fp8']} sequences instead of {runs['auto']}" in reason
    assert engine_arguments(p.to_dict(), __import__("pathlib").Path("/m"))["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in engine_arguments(auto.to_dict(), __import__("pathlib").Path("/m"))
    assert "option.kv_cache_dtype=fp8" in render_text_files(p, Spec.model_validate({"model": {"id": LLAMA70.id},
                                                                                       **body}))[
        "serving.properties"].decode()
    # Where the pool holds the concurrency the cache keeps the compute dtype, and says what fp8 would buy.
    small = plan({**body, "workload": {**body["workload"], "concurrency": 8}}, LLAMA70, H100)
    assert small.vllm.kv_cache_dtype == "auto" and "would hold about twice as many" in small.decision(
        "kv_cache_dtype").reason


def test_an_fp8_plan_names_one_kv_cache_dtype_in_every_decision():
    """The quantization decision said "the KV cache in bf16" beside kv_cache_dtype = fp8 (GLM-4.7's fidelity
    rows): it names the cache the plan has."""
    body = {"target": {"instance": "ml.p5.48xlarge"}, "pin": {"engine": "vllm", "tensor_parallel_degree": 8,
                                                              "dtype": "fp8"},
            "workload": {"max_input_tokens": 1024, "max_output_tokens": 1024, "concurrency": 16}}
    for kv in ("fp8", "auto"):
        p = plan({**body, "pin": {**body["pin"], "kv_cache_dtype": kv}}, LLAMA70, H100)
        reason = p.decision("quantization").reason
        assert "activations quantized to fp8" in reason
        assert reason.endswith("the KV cache in " + ("fp8" if kv == "fp8" else "bf16")), reason


def test_an_fp8_kv_pin_on_a_gpu_without_fp8_is_refused_with_the_fix():
    with pytest.raises(SpecValueError) as err:
        plan({"target": {"instance": "ml.g5.12xlarge"}, "pin": {"kv_cache_dtype": "fp8"}}, QWEN8, A10G)
    assert str(err.value) == ("pin.kv_cache_dtype = 'fp8': a10g has no fp8: vLLM's fp8 KV cache needs a GPU with "
                              "fp8 (Hopper, Ada, Blackwell); use auto")


def test_a_quantized_checkpoint_aiconfigurator_does_not_bundle_runs_on_its_kernels_data_or_says_why_not():
    pytest.importorskip("aiconfigurator_core")
    llama = catalog.model_facts("meta-llama/Llama-3.3-70B-Instruct")
    layout = StepLayout("vllm", "bf16", "bf16", 4)
    fp8 = step_times(llama.model_copy(update={"checkpoint_quantization": "fp8"}), H100, VLLM, layout)
    bf16 = step_times(llama, H100, VLLM, layout)
    assert isinstance(fp8, MeasuredSteps) and fp8.compile_args["gemm_quant_mode"] == "fp8"
    assert fp8.decode_ms(8, 2000) < bf16.decode_ms(8, 2000)  # half the weight bytes a step reads
    # No int4 GEMM data for vLLM on H100: lmc's model, and the reason without this machine's paths.
    int4 = step_times(llama.model_copy(update={"checkpoint_quantization": "int4"}), H100, VLLM, layout)
    assert int4.source == ("lmc roofline (latency.py); aiconfigurator could not model this layout: perf database "
                           "error: GEMM perf data missing for quant 'int4_wo'")
    a100 = catalog.hardware_facts("ml.p4d.24xlarge")  # no fp8 compute: vLLM runs an fp8 checkpoint weight-only
    assert step_times(llama.model_copy(update={"checkpoint_quantization": "fp8"}), a100, VLLM, layout).source == (
        "lmc roofline (latency.py); aiconfigurator has no data for vLLM's kernels of a fp8 checkpoint on a100-40gb")


def test_an_expert_parallel_plan_is_stepped_as_aiconfigurators_expert_parallel_moe():
    # MiniMax-M2.5's fp8 experts are 1536 wide in 128 x 128 blocks: split over 8 ranks (192 each) they fit no
    # block, which vLLM refuses and aiconfigurator too; whole experts on each rank (EP 8) are what it measured.
    pytest.importorskip("aiconfigurator_core")
    minimax = catalog.model_facts("MiniMaxAI/MiniMax-M2.5")
    split = step_times(minimax, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 8))
    assert isinstance(split, RooflineSteps) and "moe_tp_size=8) % weight_block_size=128" in split.source
    whole = step_times(minimax, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 8, ep=True))
    assert isinstance(whole, MeasuredSteps)
    assert (whole.compile_args["moe_tp_size"], whole.compile_args["moe_ep_size"]) == (1, 8)
    pinned = plan({"target": {"instance": "ml.p5.48xlarge"},
                   "pin": {"engine": "vllm", "tensor_parallel_degree": 8, "expert_parallel": True, "replicas": 1}},
                  minimax, H100)
    # measured data, which only the expert-parallel layout has (the split one is lmc's roofline, above)
    assert pinned.vllm.enable_expert_parallel and pinned.predicted.step_times == whole.source

# The MoE layouts engines.toml's moe_layer_overhead_ms was derived from (aiconfigurator's measured data on H100).
MOE_LAYOUTS = [("openai/gpt-oss-20b", 1), ("openai/gpt-oss-120b", 1), ("openai/gpt-oss-120b", 8),
               ("Qwen/Qwen3-30B-A3B", 1), ("Qwen/Qwen3-235B-A22B", 8), ("mistralai/Mixtral-8x7B-v0.1", 2),
               ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 4)]


# Whole 128-column blocks per rank, which aiconfigurator's Triton fp8 data need.
FP8_MOE_LAYOUTS = [("Qwen/Qwen3-30B-A3B", 1, False), ("Qwen/Qwen3-235B-A22B", 8, True),
                   ("mistralai/Mixtral-8x7B-v0.1", 2, False)]


def test_online_fp8_experts_are_stepped_as_the_triton_kernel_vllm_runs_for_them():
    # vLLM's online fp8 (dynamic activation scales) runs Triton's fused fp8 MoE: aiconfigurator's "fp8_block" table.
    # Its "fp8" table is FlashInfer's CUTLASS experts with static scales (ModelOpt checkpoints), 1.3-4.1x slower at
    # decode batches, which planned lmc's fp8 MoE layouts before; lmc's own model agrees with the Triton data.
    pytest.importorskip("aiconfigurator_core")
    ratios = []
    for model_id, tp, ep in FP8_MOE_LAYOUTS:
        model = catalog.model_facts(model_id)
        layout = StepLayout("vllm", "fp8", "bf16", tp, 1, ep)
        measured = step_times(model, H100, VLLM, layout)
        assert isinstance(measured, MeasuredSteps), model_id
        assert (measured.compile_args["gemm_quant_mode"], measured.compile_args["moe_quant_mode"]) == ("fp8", "fp8_block")
        own = RooflineSteps(model, H100, VLLM, layout)
        ratios += [own.decode_ms(batch, 1024) / measured.decode_ms(batch, 1024) for batch in (1, 4, 16, 64)]
    assert all(0.7 <= ratio <= 1.3 for ratio in ratios), [round(ratio, 2) for ratio in ratios]


def test_online_fp8_experts_split_at_any_width_as_vllms_per_tensor_scales_allow(tmp_path):
    # Qwen3-235B-A22B's 1536-wide experts split 8 ways are 192 columns a rank: vLLM's online fp8 (one scale per
    # tensor) runs them; aiconfigurator's models refuse fp8_block experts that are not whole 128-column blocks
    # unless the config says the checkpoint's blocks are narrower. lmc's config says so for an unquantized
    # checkpoint: the split layout is answered from the table's nearest shape, and the whole-block layouts as before.
    pytest.importorskip("aiconfigurator_core")
    qwen = catalog.model_facts("Qwen/Qwen3-235B-A22B")
    split = step_times(qwen, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 8))
    assert isinstance(split, MeasuredSteps) and split.source.endswith("(xshape)")
    assert split.compile_args["moe_tp_size"] == 8 and split.compile_args["moe_quant_mode"] == "fp8_block"
    assert split.decode_ms(32, 2048) < step_times(qwen, H100, VLLM, StepLayout("vllm", "bf16", "bf16", 8)).decode_ms(
        32, 2048)  # fp8 experts read half the bytes of bf16 ones
    plain = str(steps._config_folder(tmp_path, steps._bundled_config(qwen.id)))
    with pytest.raises(ValueError, match="weight_block_size=128"):
        steps._compile(plain, "h100_sxm", "vllm", split.compile_args)
    whole = step_times(qwen, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 8, 1, True))  # EP: whole experts
    as_before = steps._compile(plain, "h100_sxm", "vllm", whole.compile_args)
    for batch in (1, 32):
        assert whole.decode_ms(batch, 2048) == as_before.decode_step_latency(batch, 2047, 1)


def test_lmcs_own_moe_decode_step_stays_near_the_measured_data_at_small_batches():
    # Without the MoE blocks' kernel floor (latency.moe_floor_ms) lmc's model put a batch-1 step of these layouts
    # 34-56 % under aiconfigurator's measured data for all but Mixtral (it reads only the few experts' bytes);
    # with it, every one is within 25 % at batch 1 and batch 8, and a dense model is not touched by it.
    pytest.importorskip("aiconfigurator_core")
    errors = []
    for model_id, tp in MOE_LAYOUTS:
        model = catalog.model_facts(model_id)
        dtype = "bf16" if model.checkpoint_quantization is None else model.checkpoint_quantization
        layout = StepLayout("vllm", dtype, "bf16", tp)
        measured = step_times(model, H100, VLLM, layout)
        assert isinstance(measured, MeasuredSteps), model_id
        own = RooflineSteps(model, H100, VLLM, layout)
        for batch in (1, 8):
            errors.append((own.decode_ms(batch, 1024) - measured.decode_ms(batch, 1024)) / measured.decode_ms(batch, 1024))
    assert max(abs(error) for error in errors) <= 0.25, [round(error, 3) for error in errors]
    from lmc.planner.latency import moe_floor_ms

    efficiency = VLLM.efficiency["gpu"]
    assert moe_floor_ms(efficiency, QWEN8, 1) == 0.0
    # The floor fades as the batch touches more experts: all 32 of gpt-oss-20b's at a large batch.
    oss = catalog.model_facts("openai/gpt-oss-20b")
    assert moe_floor_ms(efficiency, oss, 1) == pytest.approx(24 * efficiency.moe_layer_overhead_ms * (1 - 4 / 32))
    assert moe_floor_ms(efficiency, oss, 256) < 0.01 * moe_floor_ms(efficiency, oss, 1)


def test_the_busiest_ranks_experts_follow_uniform_routing():
    # expert_imbalance (a Binomial count per rank) against routing simulated token by token: each token picks
    # experts_per_token distinct experts uniformly; the busiest of the ranks' touched experts over their mean.
    import random

    from lmc.planner.latency import expert_imbalance

    rng = random.Random(7)
    qwen235 = catalog.model_facts("Qwen/Qwen3-235B-A22B")  # 128 experts, 8 a token
    glm = catalog.model_facts("zai-org/GLM-4.7")  # 160 experts, 8 a token
    for model, ranks, tokens in [(qwen235, 8, 1), (qwen235, 8, 4), (qwen235, 8, 32), (glm, 8, 4), (glm, 8, 64),
                                 (qwen235, 16, 16)]:
        experts, k, per_rank = model.num_experts, model.experts_per_token, model.num_experts // ranks
        busiest, mean = 0.0, 0.0
        for _ in range(4000):
            touched = set()
            for _ in range(tokens):
                touched.update(rng.sample(range(experts), k))
            counts = [sum(1 for e in touched if e // per_rank == r) for r in range(ranks)]
            busiest += max(counts)
            mean += len(touched) / ranks
        simulated = busiest / mean
        assert expert_imbalance(model, ranks, tokens) == pytest.approx(simulated, rel=0.08), (model.id, ranks, tokens)
    # Split experts, a dense model, or every expert touched: no imbalance.
    assert expert_imbalance(qwen235, 1, 4) == expert_imbalance(QWEN8, 8, 4) == 1.0
    assert expert_imbalance(qwen235, 8, 4096) == pytest.approx(1.0, abs=1e-6)


def test_lmcs_own_expert_parallel_step_costs_what_the_measured_data_add_over_split_experts():
    # With whole experts per rank a decode step waits for the rank whose experts the batch touched most: in
    # aiconfigurator's data Qwen3-235B-A22B's EP-8 step is 1.09-1.33x its split-expert step at 4-64 requests.
    # lmc's own model priced both alike before (ratio 1.00); it now follows the data within 10 %.
    pytest.importorskip("aiconfigurator_core")
    qwen235 = catalog.model_facts("Qwen/Qwen3-235B-A22B")
    split, whole = StepLayout("vllm", "bf16", "bf16", 8), StepLayout("vllm", "bf16", "bf16", 8, ep=True)
    data_split, data_whole = step_times(qwen235, H100, VLLM, split), step_times(qwen235, H100, VLLM, whole)
    assert isinstance(data_split, MeasuredSteps) and isinstance(data_whole, MeasuredSteps)
    own_split, own_whole = RooflineSteps(qwen235, H100, VLLM, split), RooflineSteps(qwen235, H100, VLLM, whole)
    for batch in (4, 16, 64):
        data = data_whole.decode_ms(batch, 1024) / data_split.decode_ms(batch, 1024)
        own = own_whole.decode_ms(batch, 1024) / own_split.decode_ms(batch, 1024)
        assert data > 1.05 and own == pytest.approx(data, rel=0.10), (batch, round(own, 3), round(data, 3))


def test_a_prompt_joins_one_data_parallel_group_not_every_group_at_once():
    # aiconfigurator's prefill with attention_dp_size = G is every group prefilling at once: its MoE blocks carry
    # G x the tokens. A prompt joins one group; its tokens spread over every rank's experts. The plan took the
    # every-group figure for one prompt: DeepSeek-V3 as wide EP (DP 16, the spec in specs/) had a TTFT of 5.0 s
    # and a TPOT of 187 ms ("goal missed") where lmc's own model said 0.53 s and 40 ms.
    pytest.importorskip("aiconfigurator_core")
    qwen235 = catalog.model_facts("Qwen/Qwen3-235B-A22B")
    s = step_times(qwen235, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 1, 8, True))
    assert isinstance(s, MeasuredSteps) and s.groups == 8
    assert s.source.endswith("a prompt's prefill: one DP group's, from its per-operation times")  # named in the plan
    handle = s.handle()
    # The split into per-operation times is aiconfigurator's own: at one group they add up to its prefill.
    assert steps.one_group_prefill_ms(handle, 4096, 1) == pytest.approx(handle.predict_prefill_latency(1, 4096))
    every_group, one_group = handle.predict_prefill_latency(1, 4096), s.prefill_ms(4096)
    # the same experts' load as every group's 512 tokens, and one group's attention over its 4096
    assert handle.predict_prefill_latency(1, 512) < one_group < every_group / 3, (one_group, every_group)
    own = RooflineSteps(qwen235, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 1, 8, True))
    assert one_group == pytest.approx(own.prefill_ms(4096), rel=0.5), (one_group, own.prefill_ms(4096))
    # A chunk beside the other groups' decodes: the decode step plus the chunk's prefill beyond one token.
    assert s.mixed_ms(2048, 4, 4096, 4608) == pytest.approx(
        s.decode_ms(4, 4608) + s.prefill_ms(2048) - s.prefill_ms(1))
    # The wide-EP spec meets its goal again, with figures near lmc's own model's (0.53 s, 40 ms).
    deepseek = catalog.model_facts("deepseek-ai/DeepSeek-V3")
    wide = plan({"target": {"instance": "ml.p5.48xlarge", "instances": 2}, "goal": {"tpot_ms": 80, "ttft_ms": 5000},
                 "workload": {"max_input_tokens": 4096, "max_output_tokens": 1024, "concurrency": 32},
                 "pin": {"data_parallel_degree": 16}}, deepseek, H100)
    assert wide.vllm.data_parallel_size == 16 and wide.goal_met
    assert wide.predicted.ttft_ms < 1000 and wide.predicted.tpot_ms < 80


def test_an_architecture_vllm_runs_as_llama_is_stepped_on_aiconfigurators_llama_data():
    # aiconfigurator names no MistralForCausalLM, though vLLM serves it with Llama's layers: its data answer for
    # the same shapes read as LlamaForCausalLM, and the plan says so.
    pytest.importorskip("aiconfigurator_core")
    mistral = catalog.model_facts("mistralai/Mistral-Small-24B-Instruct-2501")
    s = step_times(mistral, H100, VLLM, BF16)
    assert isinstance(s, MeasuredSteps)
    assert s.source == ("aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0; MistralForCausalLM read "
                        "as LlamaForCausalLM)")
    as_llama = step_times(mistral.model_copy(update={"architecture": "LlamaForCausalLM"}), H100, VLLM, BF16)
    assert as_llama.source == "aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0)"
    for batch in (1, 32):
        assert s.decode_ms(batch, 2048) == as_llama.decode_ms(batch, 2048)
    assert s.prefill_ms(4096) == as_llama.prefill_ms(4096) and s.prefill_ms(4096) > 2 * s.prefill_ms(1024)
    # A layer aiconfigurator's Llama has not (Mistral-7B-v0.1 slides a 4096-token window) stays lmc's, and why;
    # an architecture vLLM does not run as Llama stays unknown to it.
    sliding = step_times(catalog.model_facts("mistralai/Mistral-7B-v0.1"), H100, VLLM, BF16)
    assert sliding.source == ("lmc roofline (latency.py); aiconfigurator's model of MistralForCausalLM has no "
                              "sliding-window layers")
    lite = catalog.model_facts("zai-org/GLM-4.7").model_copy(update={"architecture": "Glm4MoeLiteForCausalLM"})
    assert step_times(lite, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 8, ep=True)).source == (
        "lmc roofline (latency.py); aiconfigurator has no model of Glm4MoeLiteForCausalLM")


def test_glm4s_moe_layout_is_stepped_as_aiconfigurators_step_family_with_its_unmeasured_experts_transferred():
    # GLM-4.7: 3 dense blocks, then 89 of 160 experts (8 a token, 1536 wide) beside a shared one, full GQA attention.
    # aiconfigurator names no Glm4MoeForCausalLM; its Step-3.5 family builds those blocks. Its MoE tables hold no
    # 160 x 5120 x 1536 shape, so its measured data alone refuse the step, and its HYBRID mode answers from the
    # nearest measured shape (XSHAPE); the plan says both.
    pytest.importorskip("aiconfigurator_core")
    glm = catalog.model_facts("zai-org/GLM-4.7")
    assert (glm.moe_layers, glm.dense_intermediate_size, glm.shared_expert_width) == (89, 12288, 1536)
    config = steps.aic_config(glm)
    assert config["architectures"] == ["Step3p5ForCausalLM"] and config["first_k_dense_replace"] == 3
    assert set(config["layer_types"]) == {"full_attention"} and len(config["layer_types"]) == 92
    assert (config["intermediate_size"], config["moe_intermediate_size"], config["share_expert_dim"]) == (
        12288, 1536, 1536)
    s = step_times(glm, H100, VLLM, StepLayout("vllm", "fp8", "fp8", 8, ep=True))
    assert isinstance(s, MeasuredSteps)
    assert s.source == ("aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0; Glm4MoeForCausalLM read as "
                        "Step3p5ForCausalLM); shapes it has not measured from its nearest measured ones (xshape)")
    assert s.shared_ffn == ()  # the family's own shared-expert GEMMs: lmc adds none
    assert "MoE data missing" in str(s._silicon_error()) and "num_experts: 160" in str(s._silicon_error())
    # Its op graph: the dense MLP in 3 blocks, the routed and the shared experts in 89.
    ops, _ = s.handle().run_static_per_op(batch_size=1, isl=1024, osl=2)
    names = {op[0] for op in ops}
    assert any("shared_expert" in name for name in names) and any(steps.moe_op(name) for name in names)
    # The answers grow as a decode step's should, and the transfer does not touch measured shapes: a model the
    # tables hold answers the same as on its measured data alone (test_measured_steps_are_aiconfigurators_own_numbers).
    assert s.decode_ms(1, 1024) < s.decode_ms(16, 1024) < s.decode_ms(64, 1024)
    assert s.prefill_ms(4096) > 2 * s.prefill_ms(1024)
    # vLLM serves it from glm4_moe.py: dense blocks below first_k_dense_replace, then experts with shared ones.
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    assert registry._TEXT_GENERATION_MODELS["Glm4MoeForCausalLM"] == ("glm4_moe", "Glm4MoeForCausalLM")


def test_a_transfer_far_from_lmcs_own_model_is_not_planned_on(step_cache, monkeypatch):
    # aiconfigurator's transfer can be absurd (A100, Qwen3-235B-A22B's experts held out of its table: a one-token
    # decode step 132x the measured one, bench/xshape_holdout.py). A transferred layout whose answer at one of the
    # probed batches or prompts is more than 3x lmc's own model is planned on lmc's own model, and says why.
    glm, layout = catalog.model_facts("zai-org/GLM-4.7"), StepLayout("vllm", "fp8", "fp8", 8, ep=True)
    measured = steps._measured(glm, H100, VLLM, layout)
    own = RooflineSteps(glm, H100, VLLM, layout)
    assert isinstance(measured, MeasuredSteps) and measured.unavailable() is None and measured.transferred
    assert steps.implausible_transfer(measured, own) is None  # its real answers are within the bound
    measured.save()
    answers = json.loads(measured.cache_file.read_text())
    answers["d8,1023"] = 40 * own.decode_ms(8, 1024)  # as if its transfer had answered that
    measured.cache_file.write_text(json.dumps(answers))
    monkeypatch.setattr(steps, "_MEASURED", {})  # a new process
    s = step_times(glm, H100, VLLM, layout)
    assert isinstance(s, RooflineSteps)
    assert s.source.startswith("lmc roofline (latency.py); aiconfigurator's transfer from its nearest measured shapes "
                               "put a decode step of 8 at 1024 tokens at ") and s.source.endswith(": not used")
    assert "40.0x lmc's own model" in s.source


def test_which_transfer_answered_is_cached_with_the_answers(step_cache, monkeypatch):
    glm, layout = catalog.model_facts("zai-org/GLM-4.7"), StepLayout("vllm", "fp8", "fp8", 8, ep=True)
    first = step_times(glm, H100, VLLM, layout)
    qwen = step_times(QWEN8, H100, VLLM, BF16)
    answer = first.decode_ms(16, 2000)
    steps.save_step_times()
    monkeypatch.setattr(steps, "_MEASURED", {})  # a new process
    monkeypatch.setattr(steps, "_compile", lambda *args: pytest.fail("compiled although the answer was cached"))
    second = step_times(glm, H100, VLLM, layout)
    assert second.source == first.source and second.source.endswith("(xshape)") and second.decode_ms(16, 2000) == answer
    assert step_times(QWEN8, H100, VLLM, BF16).source == qwen.source == (
        "aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0)")


def test_the_architectures_read_as_llama_are_the_ones_vllm_runs_on_its_llama_model():
    registry = pytest.importorskip("vllm.model_executor.models.registry")
    from importlib import import_module

    from vllm.model_executor.models.llama import LlamaForCausalLM

    for architecture in sorted(steps.LLAMA_LAYOUT):
        module, name = registry._TEXT_GENERATION_MODELS[architecture]
        served = getattr(import_module(f"vllm.model_executor.models.{module}"), name)
        assert issubclass(served, LlamaForCausalLM), (architecture, module, name)


def test_the_shared_experts_aiconfigurators_moe_families_leave_out_are_added_from_its_gemm_data():
    # Llama 4 runs a shared expert as wide as a routed one beside them in every MoE block (vLLM's llama4.py);
    # aiconfigurator's hybrid-MoE family builds the block without it. The plan adds it from its GEMM data.
    pytest.importorskip("aiconfigurator_core")
    scout = catalog.model_facts("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    s = step_times(scout, H100, VLLM, StepLayout("vllm", "bf16", "bf16", 4))
    assert isinstance(s, MeasuredSteps) and s.shared_ffn == (48, 5120, 8192 // 4, "bfloat16", 1)
    assert s.source == ("aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0); the shared experts its "
                        "model leaves out: from its GEMM data")
    handle = s.handle()
    # A decode step of 16: on vLLM's second stream beside the routed block, which takes longer: hidden.
    shared = steps.shared_experts_ms(handle, s.shared_ffn, 16)
    routed = steps.routed_moe_ms(handle.decode_step_per_op(16, 8191, 1))
    assert 0 < shared < routed and s.decode_ms(16, 8192) == handle.decode_step_latency(16, 8191, 1)
    # A prompt of 8192 tokens: after the routed experts. Each token passes one routed expert as wide as the
    # shared one: the same FLOPs, which one dense GEMM runs at least as fast as the grouped experts' kernel
    # (the data: about twice as fast). Not split over the 4 ranks, or not in all 48 blocks, it would be out.
    added = s.prefill_ms(8192) - handle.predict_prefill_latency(1, 8192)
    own, _ = handle.run_static_per_op(batch_size=1, isl=8192, osl=2)
    experts = sum(ms for name, ms, *_ in own if name.endswith("_moe"))
    assert added == pytest.approx(steps.shared_experts_ms(handle, s.shared_ffn, 8192))
    assert 0.3 < added / experts <= 1, (added, experts)
    # Data-parallel groups of 4 ranks with expert parallelism: vLLM's MoE is sequence parallel, each rank runs
    # the shared expert whole on a quarter of the tokens.
    dp = step_times(scout, H100, VLLM, StepLayout("vllm", "bf16", "bf16", 4, 2, True))
    assert dp.shared_ffn == (48, 5120, 8192, "bfloat16", 4)
    # Families that model their shared experts (DeepSeek) or models without them get nothing added.
    deepseek = step_times(catalog.model_facts("deepseek-ai/DeepSeek-V3"), H100, VLLM,
                          StepLayout("vllm", "fp8", "bf16", 8))
    qwen = step_times(catalog.model_facts("Qwen/Qwen3-30B-A3B"), H100, VLLM, BF16)
    assert deepseek.shared_ffn == () and qwen.shared_ffn == ()
    assert qwen.prefill_ms(4096) == qwen.handle().predict_prefill_latency(1, 4096)


def test_the_shared_experts_stream_threshold_is_vllms():
    envs = pytest.importorskip("vllm.envs")
    assert steps.SHARED_STREAM_TOKENS == envs.VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD


def test_a_block_fp8_checkpoint_is_read_as_aiconfigurator_reads_it():
    deepseek = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert steps.block_fp8_gemms(deepseek, {"tp_size": 8})
    assert not steps.block_fp8_gemms(deepseek, {"gemm_quant_mode": "fp8"})  # lmc's own mode for its GEMMs
    assert not steps.block_fp8_gemms({"quantization_config": steps.ONLINE_FP8_BLOCKS}, {})  # online fp8
    assert not steps.block_fp8_gemms({"quantization_config": {"quant_method": "fp8"}}, {})  # per-tensor scales
    assert not steps.block_fp8_gemms({}, {})
    compressed = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}}}}}
    assert steps.block_fp8_gemms(compressed, {})


def test_block_fp8_gemms_come_from_a_graph_timed_table_of_the_same_gpu(step_cache, monkeypatch):
    pd = pytest.importorskip("pandas")
    monkeypatch.setattr(steps, "_cache_root", lambda: step_cache / "lmc" / "step_times")
    timed = steps.graph_timed_systems("h100_sxm")  # remembered per folder: this HF_HOME's own
    folder, donor = timed.folder, timed.donor
    assert donor.startswith("sglang ") and folder.startswith(str(step_cache)) and not timed.refused
    version = donor.split()[1]
    source = Path(importlib.util.find_spec("aiconfigurator_core").origin).parent / "systems" / "data" / "h100_sxm"
    before = pd.read_parquet(next((source / "gemm" / "vllm").glob("*/gemm_perf.parquet")))
    after = pd.read_parquet(next((Path(folder) / "data" / "h100_sxm" / "gemm" / "vllm").glob("*/gemm_perf.parquet")))
    donated = pd.read_parquet(source / "gemm" / "sglang" / version / "gemm_perf.parquet")
    def block(frame):
        return frame[frame.gemm_dtype == "fp8_block"].set_index(["m", "n", "k"]).latency.sort_index()

    # every other GEMM as it was; the block-fp8 ones are the SGLang table's, under vLLM's name
    assert len(after[after.gemm_dtype != "fp8_block"]) == len(before[before.gemm_dtype != "fp8_block"])
    assert block(after).equals(block(donated)) and set(after.framework) == set(before.framework)
    # the eager timing it replaces: a one-token 1024 x 3072 GEMM 7x the graph-timed one
    assert block(before).loc[(1, 1024, 3072)].min() > 5 * block(after).loc[(1, 1024, 3072)].min()


def test_a_block_fp8_checkpoints_decode_step_drops_the_eager_launches_and_says_so():
    pytest.importorskip("aiconfigurator_core")
    minimax = catalog.model_facts("MiniMaxAI/MiniMax-M2.5")
    layout = StepLayout("vllm", "fp8", "bf16", 8, ep=True)
    graph_timed = step_times(minimax, H100, VLLM, layout)
    assert isinstance(graph_timed, MeasuredSteps) and graph_timed.systems is not None
    assert ("; block-fp8 GEMMs from its sglang 0.5.14 table (its vLLM one is timed without CUDA graphs)"
            in graph_timed.source)
    eager = MeasuredSteps(graph_timed.system, graph_timed.backend, graph_timed.model_ref, graph_timed.compile_args,
                          None, graph_timed.layers, qk_norm_ranks=graph_timed.qk_norm_ranks)
    # 62 layers x two block-fp8 GEMMs (QKV, output) of ~60 µs eagerly, ~7 µs in a graph: ~6 ms of a one-token step
    assert 4.0 < eager.decode_ms(1, 1024) - graph_timed.decode_ms(1, 1024) < 8.0
    # an unquantized checkpoint's layouts read aiconfigurator's own folder
    assert step_times(QWEN8, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 1)).systems is None


def test_where_the_graph_timed_copy_cannot_be_made_the_plan_says_which_table_it_read(step_cache, monkeypatch):
    pytest.importorskip("aiconfigurator_core")
    monkeypatch.setattr(steps, "_cache_root", lambda: step_cache / "lmc" / "step_times")
    (step_cache / "lmc").mkdir(parents=True)
    (step_cache / "lmc" / "aic_systems").write_text("not a folder")  # nothing can be written under it
    timed = steps.graph_timed_systems("h100_sxm")
    assert timed.folder is None and not timed.donor
    assert timed.refused.startswith("its graph-timed copy could not be made under ")
    minimax = catalog.model_facts("MiniMaxAI/MiniMax-M2.5")
    eager = step_times(minimax, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 8, ep=True))
    assert isinstance(eager, MeasuredSteps) and eager.systems is None
    assert "; block-fp8 GEMMs from its vLLM table, timed without CUDA graphs (its graph-timed copy could not" \
        in eager.source


def test_a_qk_norm_over_all_heads_costs_vllm_an_all_reduce_a_block_at_tp_above_one():
    pytest.importorskip("aiconfigurator_core")
    minimax = catalog.model_facts("MiniMaxAI/MiniMax-M2.5")
    assert minimax.qk_norm_allreduce and not QWEN8.qk_norm_allreduce  # Qwen3's per-head norm needs none
    plain = minimax.model_copy(update={"qk_norm_allreduce": False})
    # lmc's own model: one all-reduce of two fp32 numbers a token in every block, nothing at TP 1
    own = [RooflineSteps(facts, H100, VLLM, StepLayout("vllm", "fp8", "bf16", 8, ep=True)).decode_ms(16, 1024)
           for facts in (minimax, plain)]
    assert own[0] - own[1] == pytest.approx(
        minimax.layers * latency.allreduce_ms(H100, VLLM.efficiency["gpu"], 8, 16 * 8))
    assert (RooflineSteps(minimax, H100, VLLM, BF16).decode_ms(1, 1024)
            == RooflineSteps(plain, H100, VLLM, BF16).decode_ms(1, 1024))
    # on measured data: aiconfigurator's MiniMax model has no such op; its custom all-reduce data add it
    layout = StepLayout("vllm", "fp8", "bf16", 8, ep=True)
    measured = step_times(minimax, H100, VLLM, layout)
    assert measured.qk_norm_ranks == 8 and "the q/k norm's all-reduce its model leaves out" in measured.source
    without = step_times(plain, H100, VLLM, layout)
    extra = measured.decode_ms(1, 1024) - without.decode_ms(1, 1024)
    assert 62 * 0.003 < extra < 62 * 0.008  # a few µs a block: the kernel's floor at 8 ranks, not a scaled-down nothing
