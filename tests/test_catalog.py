"""The built-in catalogs: every entry validates, figures agree with each other and with the datasheets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.errors import SpecValueError
from lmc.planner import catalog
from lmc.planner.architecture import facts_from_config
from lmc.planner.facts import DTYPE_BYTES, HardwareFacts, ModelFacts
from lmc.planner.memory import kv_bytes_per_token

GIB = 2**30
REQUIRED_MODELS = [
    "EleutherAI/gpt-j-6b", "nomic-ai/gpt4all-j", "EleutherAI/gpt-neox-20b", "facebook/opt-13b", "facebook/opt-30b",
    "facebook/opt-66b", "bigscience/bloom-7b1", "bigscience/bloom", "google/flan-t5-xl", "google/flan-t5-xxl",
    "google/flan-ul2", "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-70b-hf",
    "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.1-70B-Instruct", "mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.2",
    "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-72B",
    "Qwen/Qwen2.5-72B-Instruct",
]
# Published exact counts (the brief's list): a transcription slip in a data file shows up here.
PUBLISHED_PARAMETERS = {
    "EleutherAI/gpt-j-6b": 6053381344, "meta-llama/Llama-2-7b-hf": 6738415616, "meta-llama/Llama-3.1-8B": 8030261248,
    "mistralai/Mistral-7B-v0.1": 7241732096, "mistralai/Mixtral-8x7B-v0.1": 46702792704,
    "bigscience/bloom": 176247271424, "EleutherAI/gpt-neox-20b": 20554567680, "Qwen/Qwen2.5-7B": 7615616512,
    "Qwen/Qwen2.5-72B": 72706203648, "google/flan-t5-xxl": 11135332352, "google/flan-t5-xl": 2849757184,
    "facebook/opt-66b": 65735143424, "facebook/opt-30b": 29974856704, "facebook/opt-13b": 12853473280,
    "bigscience/bloom-7b1": 7069016064,
}


# --- models -------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_id", REQUIRED_MODELS)
def test_required_model_is_in_the_catalog(model_id):
    facts = catalog.model_facts(model_id)
    assert isinstance(facts, ModelFacts)
    assert facts.id == model_id
    assert "huggingface.co/" in facts.source and "config.json" in facts.source
    assert "parameters" in facts.source


@pytest.mark.parametrize("model_id", catalog.list_models())
def test_parameter_count_agrees_with_the_architecture(model_id):
    # A count recorded from the published checkpoint and the one its config.json implies agree.
    facts = catalog.model_facts(model_id)
    path = catalog._model_index()[model_id.lower()][1]
    estimate = facts_from_config(json.loads((path / "config.json").read_text()), model_id, source="test").parameters
    assert abs(estimate - facts.parameters) / facts.parameters < 0.01, (estimate, facts.parameters)


@pytest.mark.parametrize(("model_id", "count"), sorted(PUBLISHED_PARAMETERS.items()))
def test_parameter_count_is_the_published_one(model_id, count):
    assert catalog.model_facts(model_id).parameters == count


def test_gpt_j_fp16_weights_are_about_12_gb():
    facts = catalog.model_facts("EleutherAI/gpt-j-6b")
    assert abs(facts.parameters * DTYPE_BYTES["fp16"] - 12.1e9) / 12.1e9 < 0.03


def test_bloom_176b_bf16_weights_are_about_352_gb():
    facts = catalog.model_facts("bigscience/bloom")
    assert facts.torch_dtype == "bf16"
    assert abs(facts.parameters * DTYPE_BYTES["bf16"] - 352e9) / 352e9 < 0.01


def test_published_config_values_spot_checks():
    llama70 = catalog.model_facts("meta-llama/Llama-2-70b-hf")
    assert (llama70.layers, llama70.hidden_size, llama70.attention_heads, llama70.kv_heads) == (80, 8192, 64, 8)
    mixtral = catalog.model_facts("mistralai/Mixtral-8x7B-v0.1")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.intermediate_size) == (8, 2, 14336)
    qwen = catalog.model_facts("Qwen/Qwen2.5-7B")
    assert (qwen.attention_heads, qwen.kv_heads, qwen.head_dim, qwen.vocab_size) == (28, 4, 128, 152064)
    assert catalog.model_facts("Qwen/Qwen2.5-7B-Instruct").max_position_embeddings == 32768
    t5 = catalog.model_facts("google/flan-t5-xxl")
    assert t5.is_encoder_decoder and (t5.encoder_layers, t5.layers, t5.head_dim, t5.intermediate_size) == (24, 24, 64, 10240)
    ul2 = catalog.model_facts("google/flan-ul2")
    assert ul2.family == "t5" and (ul2.attention_heads, ul2.head_dim) == (16, 256)
    assert catalog.model_facts("bigscience/bloom").max_position_embeddings is None
    assert catalog.model_facts("facebook/opt-66b").tie_word_embeddings is True


def test_glm_4_7_moe_facts():
    from lmc.planner.engines import engine_facts
    from lmc.planner.memory import kv_bytes_per_token, weight_bytes

    glm = catalog.model_facts("zai-org/GLM-4.7")
    assert (glm.family, glm.attention, glm.layers, glm.hidden_size) == ("glm4_moe", "gqa", 92, 5120)
    assert (glm.attention_heads, glm.kv_heads, glm.head_dim, glm.max_position_embeddings) == (96, 8, 128, 202752)
    # 160 routed experts (top 8) and one shared in blocks 3-91; blocks 0-2 dense
    assert (glm.num_experts, glm.experts_per_token, glm.shared_experts, glm.moe_layers) == (160, 8, 1, 89)
    assert glm.intermediate_size == 1536 and glm.expert_parameters == 89 * 160 * 3 * 5120 * 1536
    # Published (zai-org's README, GLM-4.5 report): 355B total, 32B active; the active figure leaves out the
    # embedding and the LM head, the total the MTP layer the Hub checkpoint adds.
    assert abs(glm.parameters - 355e9) / 355e9 < 0.01
    assert glm.active_parameters == glm.parameters - glm.expert_parameters + glm.expert_parameters * 8 // 160
    assert abs(glm.active_parameters - 2 * glm.vocab_size * glm.hidden_size - 32e9) / 32e9 < 0.01
    # K and V of 8 heads × 128 in 92 layers; one kv head per rank at TP 8
    assert kv_bytes_per_token(glm, 1, "bf16") == 2 * 92 * 8 * 128 * 2
    assert kv_bytes_per_token(glm, 8, "fp8") == 2 * 92 * 1 * 128 * 1
    # fp8 on 8 H100s: one byte per TP-split weight, embedding and LM head in bf16 (the head split over ranks)
    rank = weight_bytes(glm, engine_facts()["vllm"], "fp8", 8, catalog.hardware_facts("ml.p5.48xlarge"))
    embedding = glm.vocab_size * glm.hidden_size
    assert (glm.parameters - 2 * embedding) / 8 < rank < (glm.parameters - 2 * embedding) / 8 + 2 * 2 * embedding


def test_minimax_m2_5_is_a_256_expert_top_8_moe_of_about_230b_with_fp8_blocks():
    # MiniMaxAI/MiniMax-M2.5 (its config.json: the trimmed copy aiconfigurator ships), counted here by hand.
    layers, hidden, heads, kv_heads, head_dim, vocab, experts, width = 62, 3072, 48, 8, 128, 200064, 256, 1536
    m = catalog.model_facts("MiniMaxAI/MiniMax-M2.5")
    assert (m.family, m.layers, m.hidden_size, m.attention_heads, m.kv_heads, m.head_dim, m.attention) == (
        "minimax_m2", layers, hidden, heads, kv_heads, head_dim, "gqa")
    # every block is MoE: 256 experts of width 1536 (intermediate_size), 8 a token, no shared expert
    assert (m.num_experts, m.experts_per_token, m.intermediate_size, m.shared_experts, m.moe_layers) == (
        experts, 8, width, 0, layers)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + (heads + kv_heads) * head_dim
    expert_weights = layers * experts * 3 * hidden * width  # gate, up, down of every expert
    total = 2 * vocab * hidden + layers * (attention + 2 * hidden + hidden * experts) + expert_weights + hidden
    assert m.parameters == total and m.expert_parameters == expert_weights
    assert abs(m.parameters - 230e9) / 230e9 < 0.01  # "230 billion total parameters" (model.toml's source)
    assert m.active_parameters == total - expert_weights + expert_weights * 8 // experts  # 11.03B, embeddings in
    assert 10e9 < m.active_parameters < 11.1e9  # "10 billion active parameters", rounded
    # K and V of 8 heads of 128 in 62 layers: 248 KiB a token in bf16; one kv head per rank at TP 8
    assert kv_bytes_per_token(m, 1, "bf16") == layers * 2 * kv_heads * head_dim * 2 == 253_952
    assert kv_bytes_per_token(m, 8, "bf16") == 253_952 // 8 and kv_bytes_per_token(m, 8, "fp8") == 253_952 // 16
    # block-wise fp8 (1 byte a weight, a 4-byte scale per 128 x 128 block); embeddings and LM head in 16 bits
    assert m.checkpoint_quantization == "fp8" and m.quantization_method == "fp8"
    # its config names no dtype: vLLM's --dtype auto runs such a checkpoint (float32 scales) in bf16 on Hopper
    assert m.torch_dtype == "bf16"
    plain = 2 * vocab * hidden
    assert m.checkpoint_weight_bytes == pytest.approx((total - plain) * (1 + 4 / 128**2) + plain * 2, rel=1e-6)

def test_families_cover_the_brief():
    families = {catalog.model_facts(model_id).family for model_id in catalog.list_models()}
    # lmc's layout families, and the architectures people deploy today (issue 21), read from their configs
    assert families >= {"llama", "mistral", "mixtral", "qwen2", "gptj", "gpt_neox", "opt", "bloom", "t5"}
    assert families >= {"qwen3", "qwen3_moe", "gemma3", "deepseek_v3", "gpt_oss", "llama4", "phi3"}


def test_model_lookup_is_case_insensitive_and_accepts_short_names_and_aliases():
    assert catalog.model_facts("eleutherai/GPT-J-6B").id == "EleutherAI/gpt-j-6b"
    assert catalog.model_facts("gpt-j-6b").id == "EleutherAI/gpt-j-6b"
    assert catalog.model_facts("  Llama-2-7b-hf ").id == "meta-llama/Llama-2-7b-hf"
    alias = catalog.model_facts("meta-llama/llama-3.1-8b-instruct")
    assert alias.id == "meta-llama/Llama-3.1-8B-Instruct"
    assert alias.parameters == catalog.model_facts("meta-llama/Llama-3.1-8B").parameters


def test_unknown_model_suggests_the_close_one():
    with pytest.raises(SpecValueError) as caught:
        catalog.model_facts("EleutherAI/gpt-j-7b")
    message = str(caught.value)
    assert message.startswith("model.id = 'EleutherAI/gpt-j-7b': not in the built-in catalog")
    assert "did you mean EleutherAI/gpt-j-6b?" in message and "model.path" in message
    assert "\n" not in message


def test_unknown_model_without_a_close_one_lists_the_catalog():
    with pytest.raises(SpecValueError) as caught:
        catalog.model_facts("acme/zzzz")
    message = str(caught.value)
    assert "give model.path (a local checkpoint) or one of:" in message
    assert "bigscience/bloom" in message and "Qwen/Qwen2.5-72B" in message


# --- hardware -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", catalog.list_instances())
def test_every_instance_validates_and_cites(name):
    facts = catalog.hardware_facts(name)
    assert isinstance(facts, HardwareFacts)
    assert facts.name == name and name.startswith("ml.")
    assert "https://" in facts.source
    assert set(facts.tflops) <= set(DTYPE_BYTES)
    assert set(facts.dtypes) <= set(facts.tflops), "every native dtype needs its TFLOPS figure"
    assert facts.host_memory_bytes is not None and facts.host_memory_bytes >= 16 * GIB


def test_instance_families_and_sizes():
    names = set(catalog.list_instances())
    for expected in [
        "ml.g4dn.xlarge", "ml.g4dn.12xlarge", "ml.g5.xlarge", "ml.g5.12xlarge", "ml.g5.48xlarge", "ml.g6.12xlarge",
        "ml.g6e.48xlarge", "ml.p3.2xlarge", "ml.p3.8xlarge", "ml.p3.16xlarge", "ml.p3dn.24xlarge",
        "ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge",
        "ml.inf2.xlarge", "ml.inf2.8xlarge", "ml.inf2.24xlarge", "ml.inf2.48xlarge", "ml.trn1.2xlarge",
        "ml.trn1.32xlarge", "ml.trn1n.32xlarge",
    ]:
        assert expected in names


@pytest.mark.parametrize(("name", "accelerator", "devices", "memory_gib"), [
    ("ml.g4dn.12xlarge", "t4", 4, 16), ("ml.g5.12xlarge", "a10g", 4, 24), ("ml.g5.48xlarge", "a10g", 8, 24),
    ("ml.g6.xlarge", "l4", 1, 24), ("ml.g6e.12xlarge", "l40s", 4, 48), ("ml.p3.16xlarge", "v100-16gb", 8, 16),
    ("ml.p3dn.24xlarge", "v100-32gb", 8, 32), ("ml.p4d.24xlarge", "a100-40gb", 8, 40),
    ("ml.p4de.24xlarge", "a100-80gb", 8, 80), ("ml.p5.48xlarge", "h100-80gb", 8, 80),
])
def test_gpu_instances(name, accelerator, devices, memory_gib):
    facts = catalog.hardware_facts(name)
    assert (facts.accelerator, facts.kind, facts.devices) == (accelerator, "gpu", devices)
    assert facts.device_memory_bytes == memory_gib * GIB


def test_h200_memory_is_what_the_driver_reports():
    facts = catalog.hardware_facts("ml.p5e.48xlarge")
    assert facts.device_memory_bytes == 143771 * 2**20
    assert facts.memory_bandwidth_bytes_per_s == 4.8e12


@pytest.mark.parametrize(("name", "chips"), [
    ("ml.inf2.xlarge", 1), ("ml.inf2.8xlarge", 1), ("ml.inf2.24xlarge", 6), ("ml.inf2.48xlarge", 12),
    ("ml.trn1.2xlarge", 1), ("ml.trn1.32xlarge", 16), ("ml.trn1n.32xlarge", 16),
])
def test_neuron_devices_are_neuroncores(name, chips):
    facts = catalog.hardware_facts(name)
    assert facts.kind == "neuron"
    assert facts.devices == 2 * chips
    assert facts.device_memory_bytes == 16 * GIB  # half a chip's 32 GiB
    assert facts.interconnect.name == "NeuronLink-v2"
    assert facts.tflops["bf16"] == 95.0  # half a chip's 190


def test_no_bf16_on_t4_and_v100():
    for name in ("ml.g4dn.xlarge", "ml.p3.2xlarge", "ml.p3dn.24xlarge"):
        facts = catalog.hardware_facts(name)
        assert "bf16" not in facts.dtypes and "bf16" not in facts.tflops
    assert "bf16" in catalog.hardware_facts("ml.g5.xlarge").dtypes


def test_fp8_exactly_on_ada_and_hopper_gpus():
    # Decision (docs/catalog.md): dtypes are what the tensor cores compute; Ada (L4, L40S) and Hopper have fp8.
    with_fp8 = {name for name in catalog.list_accelerators()
                if catalog.accelerator_facts(name, 1).kind == "gpu" and "fp8" in catalog.accelerator_facts(name, 1).dtypes}
    assert with_fp8 == {"l4", "l40s", "h100-80gb", "h200"}


def test_interconnects():
    assert catalog.hardware_facts("ml.g5.12xlarge").interconnect.name.startswith("PCIe gen4")
    assert catalog.hardware_facts("ml.g4dn.12xlarge").interconnect.name.startswith("PCIe gen3")
    assert catalog.hardware_facts("ml.p3.2xlarge").interconnect.name.startswith("PCIe")
    for name, bandwidth in [("ml.p3.8xlarge", 150e9), ("ml.p3.16xlarge", 150e9), ("ml.p3dn.24xlarge", 150e9),
                            ("ml.p4d.24xlarge", 300e9), ("ml.p4de.24xlarge", 300e9), ("ml.p5.48xlarge", 450e9)]:
        interconnect = catalog.hardware_facts(name).interconnect
        assert interconnect.name.startswith("NVLink") and interconnect.bandwidth_bytes_per_s == bandwidth
    nvlink = catalog.hardware_facts("ml.p4d.24xlarge").interconnect
    pcie = catalog.hardware_facts("ml.g5.12xlarge").interconnect
    assert nvlink.latency_us < pcie.latency_us


def test_every_catalog_instance_has_a_price_and_says_where_it_came_from():
    """Cost, cost caps and the nearest options need a price for every instance (only `local` and a bare
    accelerator count have none): an on-demand, us-east-1 price, with its source in the catalog data."""
    unpriced = [name for name in catalog.list_instances() if catalog.hardware_facts(name).price_per_hour is None]
    assert unpriced == []
    for name in catalog.list_instances():
        source = catalog.hardware_facts(name).source
        assert "prices:" in source and "us-east-1" in source and "on-demand" in source, name


def test_prices():
    assert catalog.hardware_facts("ml.g5.12xlarge").price_per_hour == 7.09  # the design's example plan
    assert catalog.hardware_facts("ml.g5.xlarge").price_per_hour < catalog.hardware_facts("ml.g5.2xlarge").price_per_hour
    assert catalog.hardware_facts("ml.p5en.48xlarge").price_per_hour == 63.296
    assert "EC2 price" in catalog.hardware_facts("ml.g6.xlarge").source


def test_instance_lookup_with_and_without_ml_prefix():
    with_prefix = catalog.hardware_facts("ml.g5.12xlarge")
    assert catalog.hardware_facts("g5.12xlarge") == with_prefix
    assert catalog.hardware_facts(" ML.G5.12XLARGE ") == with_prefix


def test_unknown_instance_suggests_the_nearest_size():
    with pytest.raises(SpecValueError) as caught:
        catalog.hardware_facts("ml.g5.13xlarge")
    assert str(caught.value) == "target.instance = 'ml.g5.13xlarge': unknown instance; did you mean ml.g5.12xlarge?"
    assert caught.value.key_path == "target.instance"


def test_unknown_instance_family_names_the_families():
    with pytest.raises(SpecValueError) as caught:
        catalog.hardware_facts("ml.zz9.plural")
    message = str(caught.value)
    assert "unknown instance" in message and "g5" in message and "inf2" in message and '"local"' in message


def test_local_is_an_instance_name():
    assert catalog.hardware_facts("local") == catalog.local_facts()


def test_local_facts_read_the_machine_ram():
    facts = catalog.local_facts()
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert (facts.name, facts.kind, facts.devices, facts.price_per_hour) == ("local", "cpu", 1, None)
    assert facts.device_memory_bytes == total == facts.host_memory_bytes


def test_accelerator_target():
    facts = catalog.accelerator_facts("A10G", 4)
    assert (facts.name, facts.accelerator, facts.devices, facts.price_per_hour) == ("4x a10g", "a10g", 4, None)
    assert facts.interconnect.name.startswith("PCIe")
    assert facts.device_memory_bytes == 24 * GIB
    assert catalog.accelerator_facts("inf2", 2).accelerator == "inferentia2"


def test_unknown_accelerator_suggests():
    with pytest.raises(SpecValueError) as caught:
        catalog.accelerator_facts("a100-40", 2)
    assert str(caught.value) == "target.accelerator = 'a100-40': unknown accelerator; did you mean a100-40gb?"


def test_accelerator_target_needs_devices():
    with pytest.raises(SpecValueError) as caught:
        catalog.accelerator_facts("a10g", 0)
    assert str(caught.value).startswith("target.devices = 0: must be a whole number of devices")


# --- measured profiles --------------------------------------------------------------------------

PROFILE = """
name = "my-a10g-box"
accelerator = "a10g"
kind = "gpu"
devices = 2
device_memory_bytes = "22GiB"
memory_bandwidth_bytes_per_s = 5.1e11
tflops = { fp16 = 55.0, fp32 = 30.0 }
dtypes = ["fp32", "fp16"]
interconnect = { name = "PCIe gen4 x16", bandwidth_bytes_per_s = 2.2e10, latency_us = 18.0 }
source = "measured 2026-01-01 with lmc's probe"
"""


def test_profile_full(tmp_path):
    path = tmp_path / "box.toml"
    path.write_text(PROFILE)
    facts = catalog.profile_facts(path)
    assert (facts.name, facts.devices, facts.device_memory_bytes) == ("my-a10g-box", 2, 22 * GIB)
    assert facts.memory_bandwidth_bytes_per_s == 5.1e11
    assert facts.source == "measured 2026-01-01 with lmc's probe"


def test_profile_over_a_base_instance(tmp_path):
    path = tmp_path / "g5.toml"
    path.write_text('base = "g5.12xlarge"\nmemory_bandwidth_bytes_per_s = 4.9e11\n')
    facts = catalog.profile_facts(path)
    base = catalog.hardware_facts("ml.g5.12xlarge")
    assert facts.memory_bandwidth_bytes_per_s == 4.9e11
    assert (facts.devices, facts.price_per_hour, facts.tflops) == (base.devices, base.price_per_hour, base.tflops)
    assert facts.source == f"measured profile {path} over ml.g5.12xlarge"


@pytest.mark.parametrize(("text", "expected"), [
    ("name = ", "not valid TOML"),
    (PROFILE.replace('kind = "gpu"', 'kind = "tpu"'), "kind: Input should be 'gpu', 'neuron' or 'cpu'"),
    (PROFILE.replace("devices = 2\n", ""), "devices: Field required"),
    (PROFILE.replace('"22GiB"', '"22 gigs"'), "device_memory_bytes: '22 gigs' is not a size"),
    (PROFILE + "colour = 1\n", "colour: Extra inputs are not permitted"),
    ('base = "ml.g5.13xlarge"\n', "base: unknown instance; did you mean ml.g5.12xlarge?"),
    # Profiles that used to plan silently wrong (int8 on a CPU with no dtypes, 1e8 worker groups, a
    # made-up 1 TFLOPS, a CPU planned as a GPU): each is refused, naming the key.
    ('base = "local"\ndtypes = []\n', "dtypes: List should have at least 1 item"),
    ('base = "local"\ndevices = 1e8\n', "devices: Input should be less than or equal to 1024"),
    ('base = "local"\ntflops = {}\n', "tflops: no figure for fp32, bf16 (one for each of dtypes ['fp32', 'bf16'])"),
    ('base = "local"\ntflops = { fp32 = 1.0, bf16 = 1.0, fp9 = 2.0 }\n', "tflops.fp9.[key]: Input should be 'fp32'"),
    ('base = "local"\ndtypes = ["fp32", "fp32"]\n', "dtypes: ['fp32', 'fp32'] names a dtype twice"),
    ('base = "local"\nkind = "gpu"\n', "kind = 'gpu' does not fit accelerator = 'cpu'"),
    (PROFILE.replace('accelerator = "a10g"', 'accelerator = "cpu"'), "kind = 'gpu' does not fit accelerator = 'cpu'"),
    # Rates no device has: a denormal bandwidth planned an infinite TPOT and the search crashed (exit 70).
    ('base = "local"\nmemory_bandwidth_bytes_per_s = 1e-300\n',
     "memory_bandwidth_bytes_per_s: Input should be greater than or equal to 1000000"),
    ('base = "local"\ntflops = { fp32 = 1e-300, bf16 = 1.0 }\n', "tflops.fp32: Input should be greater than or equal to 0.000001"),
    ('base = "local"\ninterconnect = { name = "x", bandwidth_bytes_per_s = 1e-300, latency_us = 1.0 }\n',
     "interconnect.bandwidth_bytes_per_s: Input should be greater than or equal to 1000000"),
])
def test_profile_errors_are_one_line(tmp_path, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SpecValueError) as caught:
        catalog.profile_facts(path)
    message = str(caught.value)
    assert message.startswith(f"target.profile = {str(path)!r}: ")
    assert expected in message
    assert "\n" not in message


def test_accelerator_target_takes_as_many_devices_as_the_spec_allows():
    assert catalog.accelerator_facts("a10g", 1024).devices == 1024


def test_profile_missing_file(tmp_path):
    with pytest.raises(SpecValueError) as caught:
        catalog.profile_facts(tmp_path / "nope.toml")
    assert str(caught.value).endswith(": no such file")


# --- cost of a lookup ---------------------------------------------------------------------------

def test_catalog_lookups_import_no_heavy_modules():
    code = (
        "import sys; from lmc.planner import catalog, checkpoint_facts\n"
        "catalog.model_facts('EleutherAI/gpt-j-6b'); catalog.hardware_facts('ml.g5.12xlarge'); catalog.local_facts()\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'safetensors') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip() == ""


def test_docs_list_every_catalog_entry():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "catalog.md").read_text(encoding="utf-8")
    missing = [name for name in [*catalog.list_models(), *catalog.list_instances(), *catalog.list_accelerators()]
               if f"| {name} |" not in docs]
    assert missing == [], "docs/catalog.md is missing catalog entries (regenerate its tables)"
