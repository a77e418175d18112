"""transformers-neuronx conventions shared by the build (AOT compile) and the runtime (loading).

Pure data and one argument builder: neither side imports the other, and nothing here imports the SDK.
"""

from __future__ import annotations

from typing import Any

# One Neuron SDK release, as its packages pin each other; NEFFs only load under the compiler version
# that produced them, so the build host and the container (docker/Dockerfile.neuron) must agree.
NEURON_SDK_RELEASE = "2.18"
NEURON_SDK_PINS: dict[str, str] = {
    "transformers-neuronx": "0.10.0.21",
    "torch-neuronx": "2.1.2.2.1.0",
    "neuronx-cc": "2.13.66.0",
}
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"

NEURON_DIR = "neuron"
COMPILED_DIR = "neuron/compiled"  # where the build saves the NEFFs and the runtime loads them

# transformers-neuronx sampling class per family (exported at the package's top level).
SAMPLING_CLASSES: dict[str, str] = {
    "llama": "LlamaForSampling",
    "mistral": "MistralForSampling",
    "mixtral": "MixtralForSampling",
    "opt": "OPTForSampling",
    "bloom": "BloomForSampling",
    "gptj": "GPTJForSampling",
    "gpt_neox": "GPTNeoXForSampling",
}
# Families whose compiled graphs transformers-neuronx cannot save and load.
NOT_SERIALIZABLE: frozenset[str] = frozenset({"gptj", "gpt_neox"})

# transformers-neuronx `amp` spelling of the plan's dtype; int8 is weight-only: f16 compute.
AMP: dict[str, str] = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "int8": "f16"}


NEURON_OPTIMIZE_LEVEL = 2


def neuron_cc_flags(optimize_level: int = NEURON_OPTIMIZE_LEVEL) -> str:
    """NEURON_CC_FLAGS for every compile, at build time and at container start alike."""
    return f"--model-type=transformer -O{optimize_level}"


# Families whose sampling class takes `context_length_estimate` (the prompt-length buckets its
# context-encoding graphs are compiled for); GPT-J and GPT-NeoX encode prompts their own way.
CONTEXT_BUCKET_FAMILIES: frozenset[str] = frozenset({"llama", "mistral", "mixtral", "opt", "bloom"})


def context_buckets(n_positions: int) -> list[int]:
    """Prompt-length buckets up to n_positions: 128, 256, 512, ... and n_positions itself. Without them
    the SDK compiles buckets of half of each position bucket, and feeds a longer prompt's remaining
    tokens one decode step at a time (slow; in transformers-neuronx 0.10 a prompt exactly one token
    longer than the largest bucket even skips its last token). With n_positions as the largest
    bucket, every prompt the runtime accepts is encoded in one graph call."""
    buckets, size = [], 128
    while size < n_positions:
        buckets.append(size)
        size *= 2
    return buckets + [n_positions]


def from_pretrained_kwargs(*, family: str, dtype: str, batch_size: int, tp_degree: int,
                           n_positions: int) -> dict[str, Any]:
    """The plain `<Family>ForSampling.from_pretrained` arguments for a plan (JSON-serializable). The
    build and the runtime both call this: compiled graphs only load with the same arguments."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "tp_degree": tp_degree, "n_positions": n_positions,
                              "amp": AMP[dtype]}
    if family in CONTEXT_BUCKET_FAMILIES:
        kwargs["context_length_estimate"] = context_buckets(n_positions)
    return kwargs


def int8_neuron_config(sdk: Any, amp: str) -> Any:
    """Weight-only int8: weights stored as s8, dequantized to the compute dtype `amp`."""
    return sdk.NeuronConfig(quant=sdk.QuantizationConfig(quant_dtype="s8", dequant_dtype=amp))
