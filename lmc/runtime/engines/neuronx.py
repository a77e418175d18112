"""The `neuronx` engine: transformers-neuronx with the NEFFs the build compiled (neuron/compiled/).

transformers-neuronx shards a model across NeuronCores inside ONE process (tp_degree), so a neuronx
worker group is a single process (world_size 1); NEURON_RT_VISIBLE_CORES, set by the worker that
starts it, picks the cores. The weights are the artifact's whole model.safetensors in the plan's
dtype (the build does not split them for Neuron). Families whose graphs transformers-neuronx cannot
serialize (GPT-J, GPT-NeoX), or artifacts built without NEFFs, compile at start with to_neuron().

Generation uses the SDK's `sample()`, one call per group of requests sharing sampling parameters
(its knobs apply to the whole batch), padded to the compiled batch size. Streaming sends each
request's text as one piece when its group finishes (sample() has no per-token hook we rely on).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from lmc.errors import InternalError, MissingDependencyError
from lmc.neuron_sdk import AMP, COMPILED_DIR, NEURON_PIP_INDEX, SAMPLING_CLASSES, from_pretrained_kwargs, int8_neuron_config
from lmc.runtime.engines.base import GenerationParams, GenerationRequest, GenerationResult, TokenCallback

log = logging.getLogger(__name__)

MISSING_SDK = ("the neuronx engine needs the Neuron SDK, which is not installed: pip install transformers-neuronx "
               f"torch-neuronx neuronx-cc --extra-index-url {NEURON_PIP_INDEX}, and serve on a Neuron host "
               "(inf2/trn1) or in the LMI Neuron container")


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
        self.tokenizer = None
        self.eos_token_ids: set[int] = set()

    def load(self, model_dir: Path, rank: int, world_size: int) -> None:
        if world_size != 1 or rank != 0:
            raise InternalError("a neuronx worker group is one process (transformers-neuronx spreads the model over "
                                f"NeuronCores itself); got rank {rank} of {world_size}")
        sdk = import_sdk()
        import transformers

        from lmc.runtime.engines.hf import eos_token_ids

        model_dir = Path(model_dir)
        class_name = SAMPLING_CLASSES[self.family]
        cls = getattr(sdk, class_name, None)
        if cls is None:
            raise MissingDependencyError(f"the installed transformers-neuronx has no {class_name}; install the "
                                         f"release the artifact was compiled with (--extra-index-url {NEURON_PIP_INDEX})")
        kwargs = from_pretrained_kwargs(dtype=self.dtype, batch_size=self.batch_size, tp_degree=self.tp,
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
        model.to_neuron()
        self.model = model
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        config = transformers.AutoConfig.from_pretrained(model_dir)
        self.eos_token_ids = eos_token_ids(model_dir, config, self.tokenizer)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def generate(self, batch: list[GenerationRequest], on_token: TokenCallback | None = None) -> list[GenerationResult]:
        if self.model is None:
            raise InternalError("generate called before load")
        for request in batch:
            n = self.count_tokens(request.prompt)
            if n + request.params.max_new_tokens > self.max_sequence_length:
                raise ValueError(f"the prompt is {n} tokens and max_new_tokens is {request.params.max_new_tokens}: "
                                 f"{n + request.params.max_new_tokens} exceeds the maximum sequence length "
                                 f"{self.max_sequence_length}")
        results: dict[str, GenerationResult] = {}
        groups: dict[GenerationParams, list[GenerationRequest]] = {}
        for request in batch:
            groups.setdefault(request.params, []).append(request)
        for params, requests in groups.items():
            for start in range(0, len(requests), self.batch_size):
                for result in self._sample(params, requests[start:start + self.batch_size]):
                    results[result.id] = result
                    if on_token is not None and result.text:
                        on_token(result.id, result.text[len(_prompt_prefix(result, requests)):])
        return [results[request.id] for request in batch]

    def _sample(self, params: GenerationParams, requests: list[GenerationRequest]) -> list[GenerationResult]:
        import torch

        prompts = [self.tokenizer(r.prompt)["input_ids"] for r in requests]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_token_ids or {0})
        rows = prompts + [prompts[0]] * (self.batch_size - len(prompts))  # the compiled batch size is fixed
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in rows], dtype=torch.long)
        if params.seed is not None:
            torch.manual_seed(params.seed)  # sample() draws on the host with torch's global generator
        kwargs = {"sequence_length": min(self.max_sequence_length, width + params.max_new_tokens),
                  "top_k": params.top_k if params.do_sample else 1}
        if params.do_sample:
            kwargs.update(top_p=params.top_p, temperature=params.temperature)
        output = self.model.sample(input_ids, **kwargs)
        return [self._result(request, list(prompt), output[i, width:].tolist(), params)
                for i, (request, prompt) in enumerate(zip(requests, prompts))]

    def _result(self, request, prompt_ids, ids, params) -> GenerationResult:
        generated, finish = [], "length"
        for token in ids[:params.max_new_tokens]:
            if token in self.eos_token_ids:
                finish = "eos"
                break
            generated.append(token)
        text = self.tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
        if hits:
            text, finish = text[:min(hits)], "stop"
        if params.return_full_text:
            text = request.prompt + text
        return GenerationResult(id=request.id, text=text, prompt_tokens=len(prompt_ids),
                                generated_tokens=len(generated), finish_reason=finish, token_ids=generated)


def _prompt_prefix(result: GenerationResult, requests: list[GenerationRequest]) -> str:
    """The streamed piece is the generated text only, even with return_full_text."""
    for request in requests:
        if request.id == result.id and request.params.return_full_text:
            return request.prompt
    return ""
