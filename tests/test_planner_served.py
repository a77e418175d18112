"""LoRA adapters and speculative decoding in the plan: vLLM's LoRA slots out of the KV pool, their cost per
step, the adapters' fit to the base; speculation's tokens per step, its TPOT, the batch where it stops
paying (turned off there), the proposer's memory; other engines refuse both. Facts built in memory."""

from __future__ import annotations

import json

import pytest

from lmc.cli.main import main
from lmc.errors import NoFeasiblePlanError, SpecValueError
from lmc.planner import catalog, plan_deployment
from lmc.planner.engines import engine_facts
from lmc.planner.facts import AdapterFacts, SpeculativeFacts
from lmc.planner.lora import check_adapters, lora_slots, slot_bytes
from lmc.planner.memory import compute_dtype
from lmc.planner.speculative import check_speculative, tokens_per_step
from lmc.planner.steps import StepLayout, step_times
from lmc.planner.vllm import vllm_memory
from lmc.schema.spec import Spec

GIB = 2**30
LLAMA8 = catalog.model_facts("meta-llama/Llama-3.1-8B")
DSV3 = catalog.model_facts("deepseek-ai/DeepSeek-V3")
G6E = catalog.hardware_facts("ml.g6e.xlarge")  # one L40S, 48 GiB
G5 = catalog.hardware_facts("ml.g5.2xlarge")  # one A10G
P5EN = catalog.hardware_facts("ml.p5en.48xlarge")
VLLM = engine_facts()["vllm"]
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter(name="sql", rank=16, modules=ALL_MODULES, base="meta-llama/Llama-3.1-8B") -> AdapterFacts:
    return AdapterFacts(name=name, source=f"adapters/{name}", rank=rank, target_modules=modules, base_model=base,
                        weight_bytes=1)


def with_adapters(model=LLAMA8, count=8, rank=16):
    return model.model_copy(update={"adapters": tuple(adapter(f"a{i}", rank) for i in range(count))})


def speculating(model, method="ngram", k=4, rate=0.7, draft=None):
    return model.model_copy(update={"speculative": SpeculativeFacts(
        method=method, num_tokens=k, acceptance_rate=rate, acceptance_source="test", draft=draft,
        draft_source=None if draft is None else draft.id)})


def spec(instance="ml.g6e.xlarge", **sections) -> Spec:
    body = {"model": {"id": "x"}, "target": {"instance": instance}}
    body.update(sections)
    return Spec.model_validate(body)


def plan(s, model, hardware=G6E):
    return plan_deployment(s, model, hardware, spec_sha256="0" * 64, lmc_version="0.1.0")


# --- LoRA ------------------------------------------------------------------------------------------

def test_slots_are_every_adapter_in_a_batch_at_vllms_next_rank():
    slots = lora_slots(with_adapters(count=8, rank=12), max_num_seqs=16)
    assert (slots.max_loras, slots.max_lora_rank, slots.max_cpu_loras) == (8, 16, 8)
    slots = lora_slots(with_adapters(count=20, rank=8), max_num_seqs=16)
    assert (slots.max_loras, slots.max_lora_rank, slots.max_cpu_loras) == (16, 8, 20)  # a batch holds 16
    assert lora_slots(LLAMA8, 16) is None


def test_slot_bytes_are_vllms_stacked_a_and_b_per_layer():
    # Llama-3.1-8B: hidden 4096, q 4096, kv 1024, MLP 14336, 32 layers; rank 16, bf16.
    # TP 1: A and B whole: r·(in + out) per module.
    per_layer = 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096))
    assert slot_bytes(with_adapters(count=8), "bf16", 1, 16) == 8 * per_layer * 32 * 2
    # TP 2: column-parallel B and row-parallel A split, the rest whole.
    split = 16 * ((4096 + 4096 // 2) + 2 * (4096 + 1024 // 2) + (4096 // 2 + 4096) + 2 * (4096 + 14336 // 2)
                  + (14336 // 2 + 4096))
    assert slot_bytes(with_adapters(count=8), "bf16", 2, 16) == 8 * split * 32 * 2


def test_slots_come_out_of_the_kv_pool_and_the_kernels_cost_time():
    plain, plain_layout = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 16, 1024, 256, 0.9, None)
    model = with_adapters(count=8)
    lora, lora_layout = vllm_memory(model, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 16, 1024, 256, 0.9, None)
    assert lora.weights - plain.weights == slot_bytes(model, "bf16", 1, 16)
    assert plain_layout.pool_bytes - lora_layout.pool_bytes == slot_bytes(model, "bf16", 1, 16)
    p0 = plan(spec(pin={"engine": "vllm"}, workload={"concurrency": 16}), LLAMA8)
    p1 = plan(spec(pin={"engine": "vllm"}, workload={"concurrency": 16}), model)
    assert p1.predicted.tpot_ms > p0.predicted.tpot_ms
    assert p1.lora.max_loras == 8 and p1.lora.max_lora_rank == 16 and len(p1.lora.adapters) == 8
    assert "lora" not in p0.to_dict() and "speculative" not in p0.to_dict()
    reason = p1.decision("lora").reason
    assert "--max-loras 8" in reason and "arXiv:2310.18547" in reason


@pytest.mark.parametrize("bad, message", [
    (adapter(base="mistralai/Mistral-7B-v0.1"), "was trained on mistralai/Mistral-7B-v0.1"),
    (adapter(rank=1024), "vLLM serves ranks up to 512"),
    (adapter(modules=("q_proj", "c_attn")), "targets c_attn, which meta-llama/Llama-3.1-8B (llama) has no"),
])
def test_an_adapter_that_does_not_fit_the_base_is_one_line_on_its_key(bad, message):
    with pytest.raises(SpecValueError) as exc:
        check_adapters(LLAMA8.model_copy(update={"adapters": (bad,)}), [("adapters.0.path", "adapters/sql")])
    assert exc.value.key_path == "adapters.0.path" and message in str(exc.value)


def test_fused_module_names_and_a_renamed_org_fit():
    fits = adapter(modules=("qkv_proj", "gate_up_proj"), base="/home/me/models/Llama-3.1-8B")
    check_adapters(LLAMA8.model_copy(update={"adapters": (fits,)}), [("adapters.0.path", "adapters/sql")])


def test_other_engines_refuse_adapters_and_speculation_with_the_reason():
    with pytest.raises(NoFeasiblePlanError) as exc:
        plan(spec(pin={"engine": "hf"}), with_adapters(count=1))
    assert "hf: LoRA adapters ([[adapters]]) need vLLM (--enable-lora); lmc's hf engine" in str(exc.value)
    with pytest.raises(NoFeasiblePlanError) as exc:
        plan(spec(pin={"engine": "deepspeed"}), speculating(LLAMA8))
    assert "deepspeed: speculative decoding ([speculative]) needs vLLM (--speculative-config)" in str(exc.value)
    assert plan(spec(), with_adapters(count=1)).engine == "vllm"  # unpinned: the engine that can


# --- speculative decoding --------------------------------------------------------------------------

def test_tokens_per_step_is_leviathans_expectation():
    facts = SpeculativeFacts(method="ngram", num_tokens=1, acceptance_rate=0.5, acceptance_source="t")
    assert tokens_per_step(facts) == pytest.approx(1.5)
    facts = facts.model_copy(update={"num_tokens": 3, "acceptance_rate": 0.8})
    assert tokens_per_step(facts) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_speculation_pays_at_a_small_batch_and_is_turned_off_past_break_even():
    model = speculating(LLAMA8, "ngram", k=4, rate=0.3)  # 1.42 tokens a step
    small = plan(spec(pin={"engine": "vllm"}, workload={"concurrency": 1}), model)
    plain_small = plan(spec(pin={"engine": "vllm"}, workload={"concurrency": 1}), LLAMA8)
    assert small.speculative.enabled and small.decision("speculative").value == "ngram"
    assert small.predicted.tpot_ms < 0.75 * plain_small.predicted.tpot_ms
    stops = small.speculative.stops_paying_at_batch
    assert stops is not None and stops > 1
    busy = plan(spec(pin={"engine": "vllm", "replicas": 1}, workload={"concurrency": 256}), model)
    plain_busy = plan(spec(pin={"engine": "vllm", "replicas": 1}, workload={"concurrency": 256}), LLAMA8)
    assert busy.speculative.batch >= stops
    assert not busy.speculative.enabled and busy.decision("speculative").value == "off"
    assert "turned off" in busy.decision("speculative").reason
    assert busy.predicted.tpot_ms == plain_busy.predicted.tpot_ms  # planned without it


def test_mtp_needs_the_checkpoints_mtp_layers_and_costs_their_weights():
    with pytest.raises(SpecValueError) as exc:
        check_speculative(speculating(LLAMA8, "mtp", k=1))
    assert exc.value.key_path == "speculative.method" and "num_nextn_predict_layers" in str(exc.value)
    assert DSV3.mtp_layers == 1
    model = speculating(DSV3, "mtp", k=1, rate=0.85)
    check_speculative(model)
    p = plan(spec(instance="ml.p5en.48xlarge", workload={"concurrency": 1, "max_input_tokens": 4096,
                                                         "max_output_tokens": 1024}), model, P5EN)
    assert p.speculative.enabled and p.speculative.vllm_method == "mtp"
    # one of 61 layers' weights per device beside the model's
    assert p.speculative.draft_bytes_per_device == pytest.approx(p.memory_per_device.weights / 62, rel=0.02)
    assert p.speculative.tpot_ms_with == pytest.approx(p.speculative.tpot_ms_without * (1 + 1 / 61) / 1.85,
                                                          rel=0.02)


def test_a_draft_with_another_vocabulary_is_refused_and_a_draft_costs_its_steps():
    other = catalog.model_facts("mistralai/Mistral-7B-v0.1")
    with pytest.raises(SpecValueError) as exc:
        check_speculative(speculating(LLAMA8, "draft", draft=other))
    assert exc.value.key_path == "speculative.model" and "32000 tokens, the base's 128256" in str(exc.value)
    tiny_draft = LLAMA8.model_copy(update={"layers": 2, "parameters": LLAMA8.parameters // 16, "id": "draft"})
    model = speculating(LLAMA8, "draft", k=3, rate=0.6, draft=tiny_draft)
    p = plan(spec(pin={"engine": "vllm"}, workload={"concurrency": 1}), model)
    # the plain step is the one the plan's TPOT rests on: its step times' decode at batch 1 (aiconfigurator's
    # measured data on the L40S), not a roofline of its own
    kv = "fp8" if p.vllm.kv_cache_dtype == "fp8" else compute_dtype(p.dtype, model, G6E)
    steps = step_times(model, G6E, VLLM, StepLayout("vllm", p.dtype, kv, 1, 1))
    assert p.predicted.step_times == steps.source
    step = steps.decode_ms(1, 1024 + 256 // 2)
    assert p.speculative.tpot_ms_without == pytest.approx(step, abs=1e-3)
    # the draft's step from the same choice of step times (planner/steps.py), not a roofline of its own
    draft_steps = step_times(tiny_draft, G6E, VLLM, StepLayout("vllm", p.dtype, compute_dtype(p.dtype, model, G6E), 1))
    assert draft_steps.source == steps.source
    draft_step = draft_steps.decode_ms(1, 1024 + 256 // 2)
    # at batch 1 the verify step is the plain step and a few extra tokens' FLOPs
    assert p.speculative.tpot_ms_with == pytest.approx((step + 3 * draft_step) / (1 + .6 + .36 + .216), rel=0.02)


def test_the_plan_cli_reads_adapter_configs_and_words_a_bad_base(tmp_path, capsys):
    folder = tmp_path / "adapters" / "sql"
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": "meta-llama/Llama-3.1-8B"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    path = tmp_path / "s.toml"
    path.write_text('[model]\nid = "meta-llama/Llama-3.1-8B"\n[target]\ninstance = "ml.g6e.xlarge"\n'
                    '[[adapters]]\nname = "sql"\npath = "adapters/sql"\n')
    assert main(["plan", str(path), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["lora"]["adapters"][0]["rank"] == 16 and body["lora"]["max_lora_rank"] == 16
    # q and v of rank 16 over 32 layers, 16-bit, computed from the config (no weights file)
    assert body["lora"]["adapters"][0]["weight_bytes"] == 16 * ((4096 + 4096) + (4096 + 1024)) * 32 * 2
    config["base_model_name_or_path"] = "Qwen/Qwen3-8B"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f'lmc: error: {path}:7: adapters.0.path = "adapters/sql": adapter \'sql\' was trained') and "trained on Qwen/Qwen3-8B" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("key, value, message", [
    ("lora_alpha", "x", "`lora_alpha` must be a non-negative number, not 'x'"),
    ("lora_alpha", -1, "`lora_alpha` must be a non-negative number, not -1"),
    ("lora_alpha", [1], "`lora_alpha` must be a non-negative number, not [1]"),
    ("target_modules", 5, "`target_modules` must list module names"),
    ("target_modules", True, "`target_modules` must list module names"),
    ("base_model_name_or_path", ["x"], "`base_model_name_or_path` must be a model id or path, not ['x']"),
    ("r", True, "`r` (the LoRA rank) must be a positive integer, not True"),
])
def test_a_corrupt_adapter_config_is_one_line_on_its_key(tmp_path, capsys, key, value, message):
    """Each of these crashed the plan (exit 70: float('x'), iterating an int, pydantic's AdapterFacts error) or,
    for r = true, planned a rank-1 adapter; found by fuzzing adapter_config.json's keys."""
    folder = tmp_path / "adapters" / "sql"
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": "meta-llama/Llama-3.1-8B", key: value}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    path = tmp_path / "s.toml"
    path.write_text('[model]\nid = "meta-llama/Llama-3.1-8B"\n[target]\ninstance = "ml.g6e.xlarge"\n'
                    '[[adapters]]\nname = "sql"\npath = "adapters/sql"\n')
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f'lmc: error: {path}:7: adapters.0.path = "adapters/sql": adapter_config.json: {message}')
    assert err.count("\n") == 1


def test_the_report_shows_the_slots_and_whether_speculation_runs():
    from lmc.planner.report import render_plan

    s = spec(pin={"engine": "vllm"}, workload={"concurrency": 16})
    lora = render_plan(plan(s, with_adapters(count=8)), s)
    assert "  lora 8 adapter(s) · max_loras 8 · max_lora_rank 16 · max_cpu_loras 8 · slots 0.62 GiB" in lora
    busy = spec(pin={"engine": "vllm", "replicas": 1}, workload={"concurrency": 256})
    off = render_plan(plan(busy, speculating(LLAMA8, "ngram", k=4, rate=0.3)), busy)
    assert "speculative ngram · 4 token(s) a step · acceptance 0.3 · off: it does not pay at batch" in off


def test_the_proposers_attention_caches_in_the_same_pool():
    """vLLM gives the MTP layer's (and a draft's) attention blocks in the target's pool: a block holds the
    target's and the proposer's KV of its tokens."""
    from lmc.planner.memory import kv_bytes_per_token

    args = (P5EN, VLLM, VLLM.efficiency["gpu"], "fp8", 8, 8, 4096, 1024, 0.9, None)
    _, plain = vllm_memory(DSV3, *args)
    _, mtp = vllm_memory(speculating(DSV3, "mtp", k=1, rate=0.85), *args)
    assert plain.bytes_per_block == 16 * kv_bytes_per_token(DSV3, 8, "bf16")
    assert mtp.bytes_per_block == int(plain.bytes_per_block * (1 + 1 / 61))
    assert mtp.blocks < plain.blocks
    tiny_draft = LLAMA8.model_copy(update={"layers": 4, "id": "draft"})
    _, llama = vllm_memory(LLAMA8, G6E, VLLM, VLLM.efficiency["gpu"], "bf16", 1, 8, 1024, 256, 0.9, None)
    _, drafted = vllm_memory(speculating(LLAMA8, "draft", draft=tiny_draft), G6E, VLLM, VLLM.efficiency["gpu"],
                             "bf16", 1, 8, 1024, 256, 0.9, None)
    assert drafted.bytes_per_block == llama.bytes_per_block * 36 // 32  # 32 layers + the draft's 4
