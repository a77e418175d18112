"""The `neuronx` engine: transformers-neuronx with the NEFFs the build compiled (neuron/compiled/).

transformers-neuronx shards a model across NeuronCores inside ONE process (tp_degree), so a neuronx
worker group is a single process (world_size 1); NEURON_RT_VISIBLE_CORES, set by the worker that
starts it, picks the cores. The weights are the artifact's whole model.safetensors in the plan's
dtype (the build does not split them for Neuron). Families whose graphs transformers-neuronx cannot
serialize (GPT-J, GPT-NeoX), or artifacts built without NEFFs, compile at start with to_neuron().

Generation runs lmc's decode loop (engines/generate.py: per-request sampling, stop sequences, EOS,
token-by-token streaming) over the SDK model's forward, `model(input_ids, cache_ids, start_ids)` ->
next-token logits, which every family's `*ForSampling` class has; its own `sample()` is not used: its
knobs differ by family (only llama/mistral/mixtral take top_p and temperature, the simple loop of the
others never samples EOS) and apply to the whole batch. Rows are left-padded with `start_ids` = each
row's first real position (what transformers-neuronx's HuggingFaceGenerationModelAdapter derives from
an attention mask), padded with filler rows to the compiled batch size, and decode steps pass the
position as a one-element `cache_ids`, as the SDK's own sampling loops do. A batch is split so that
its widest prompt plus its longest max_new_tokens fits the compiled positions (n_positions).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from lmc.errors import InternalError, MissingDependencyError
from lmc.neuron_sdk import (AMP, COMPILED_DIR, NEURON_PIP_INDEX, SAMPLING_CLASSES, from_pretrained_kwargs,
                            int8_neuron_config, neuron_cc_flags)
from lmc.runtime.engines.base import CancelProbe, GenerationRequest, GenerationResult, TokenCallback

log = logging.getLogger(__name__)

MISSING_SDK = ("the neuronx engine needs the Neuron SDK, which is not installed: pip install transformers-neuronx "
               f"torch-neuronx neuronx-cc --extra-index-url {NEURON_PIP_INDEX}, and serve on a Neuron host "
               "(inf2/trn1) or in the LMI Neuron container")


# Families whose graphs mask a left-padded row's padding by its start_ids.
LEFT_PADDING_FAMILIES = frozenset({"llama", "mistral", "mixtral", "opt", "bloom", "gpt_neox"})


def import_sdk():
    try:
        import transformers_neuronx
    except ImportError:
        raise MissingDependencyError(MISSING_SDK) from None
    return transformers_neuronx


class NeuronxEngine:
    name = "neuronx"

    def __init__(self, *, family: str, task: str, dtype: str, tensor_parallel_degree: int, max_sequence_length: int,
                 batch_size: int, device: str):
        if family not in SAMPLING_CLASSES:
            raise InternalError(f"the plan chose neuronx for family {family!r}, which transformers-neuronx does not serve")
        if dtype not in AMP:
            raise InternalError(f"dtype {dtype!r} reached the neuronx engine; the planner should have rejected it")
        self.family = family
        self.dtype = dtype
        self.tp = tensor_parallel_degree
        self.max_sequence_length = max_sequence_length
        self.batch_size = batch_size
        self.model = None
        self.vocab_size = 0
        self._loop = None
        self.every_rank_answers = False  # a group is one process: nothing to do (Engine.every_rank_answers)

    def load(self, model_dir: Path, rank: int, world_size: int) -> None:
        if world_size != 1 or rank != 0:
            raise InternalError("a neuronx worker group is one process (transformers-neuronx spreads the model over "
                                f"NeuronCores itself); got rank {rank} of {world_size}")
        sdk = import_sdk()
        import torch
        import transformers

        from lmc.runtime.engines.generate import DecodeLoop
        from lmc.runtime.engines.hf import eos_token_ids

        model_dir = Path(model_dir)
        class_name = SAMPLING_CLASSES[self.family]
        cls = getattr(sdk, class_name, None)
        if cls is None:
            raise MissingDependencyError(f"the installed transformers-neuronx has no {class_name}; install the "
                                         f"release the artifact was compiled with (--extra-index-url {NEURON_PIP_INDEX})")
        kwargs = from_pretrained_kwargs(family=self.family, dtype=self.dtype, batch_size=self.batch_size, tp_degree=self.tp,
                                        n_positions=self.max_sequence_length)
        if self.dtype == "int8":
            kwargs["neuron_config"] = int8_neuron_config(sdk, kwargs["amp"])
        log.info("neuronx: %s on NeuronCores %s", class_name, os.environ.get("NEURON_RT_VISIBLE_CORES", "(all)"))
        model = cls.from_pretrained(str(model_dir), **kwargs)
        compiled = model_dir / COMPILED_DIR
        if compiled.is_dir() and any(p.is_file() for p in compiled.rglob("*")):
            model.load(str(compiled))  # the NEFFs: to_neuron() then loads instead of compiling
        else:
            log.warning("neuronx: no precompiled graphs in %s; compiling at start (slow)", compiled)
            # The same compiler flags as a build-time compile (neuron/compile.json records them).
            os.environ.setdefault("NEURON_CC_FLAGS", neuron_cc_flags())
        model.to_neuron()
        self.model = model
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        config = transformers.AutoConfig.from_pretrained(model_dir)
        self.vocab_size = config.vocab_size
        self._loop = DecodeLoop(model, tokenizer, max_sequence_length=self.max_sequence_length,
                                device=torch.device("cpu"), eos_token_ids=eos_token_ids(model_dir, config, tokenizer),
                                prefill=self._prefill)

    def count_tokens(self, text: str) -> int:
        return self._loop.count_tokens(text)

    def generate(self, batch: list[GenerationRequest], on_token: TokenCallback | None = None,
                 cancel_probe: CancelProbe | None = None) -> list[GenerationResult]:
        if self._loop is None:
            raise InternalError("generate called before load")
        # Runs fit the compiled graphs (batch size, positions). GPT-J's graphs ignore start_ids (its
        # attention mask comes from cache positions only), so a left-padded row would attend to its
        # padding: its runs hold prompts of one length.
        return self._loop.generate(batch, on_token, cancel_probe=cancel_probe, max_rows=self.batch_size,
                                   same_length=self.family not in LEFT_PADDING_FAMILIES)

    def _prefill(self, prompts: list[list[int]], pad_id: int):
        """Run the prompts through the compiled graphs; return (logits, advance) for the decode loop."""
        import torch

        n, width = len(prompts), max(len(p) for p in prompts)
        # Mistral/Mixtral count processed tokens to place their sliding window and never reset the
        # count themselves (their sample() does not either): a new batch starts at 0.
        processed = getattr(self.model, "num_processed_tokens", None)
        if isinstance(processed, torch.Tensor):
            processed.zero_()
        elif processed is not None:
            self.model.num_processed_tokens = 0
        rows = prompts + [prompts[0]] * (self.batch_size - n)  # the graphs are compiled for one batch size
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in rows], dtype=torch.long)
        start_ids = torch.tensor([width - len(p) for p in rows], dtype=torch.int32)
        position = width

        def advance(tokens: torch.Tensor) -> torch.Tensor:
            nonlocal position
            fed = torch.full((self.batch_size, 1), pad_id, dtype=torch.long)
            fed[:n, 0] = tokens.to(torch.long)
            cache_ids = torch.tensor([position], dtype=torch.int32)
            position += 1
            return self._logits(self.model(fed, cache_ids, start_ids), n)

        return self._logits(self.model(input_ids, None, start_ids), n), advance

    def _logits(self, logits, n: int):
        return logits[:n, :self.vocab_size].float()

