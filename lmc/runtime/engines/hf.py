"""The `hf` engine: plain transformers models, tensor parallel over pre-partitioned shards.

Loading never reads the whole checkpoint: the model is built from config.json with its parameters on
the meta device, reshaped for this rank (tp.py), and filled from this rank's shard file only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from lmc.errors import ArtifactError, InternalError, MissingDependencyError
from lmc.layouts import has_layout, shard_path
from lmc.runtime.engines.base import CancelProbe, GenerationRequest, GenerationResult, TokenCallback

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def read_shard(path: Path) -> dict:
    """This rank's tensors, mapped from the file without copying. The one place weights are read:
    through Python's open(), so audits see it.

    The file is mapped copy-on-write (pages come from the page cache and are shared until written;
    a write goes to a private copy, never to the file), and every tensor is a view of the mapping,
    so loading costs page faults instead of two full copies. The views keep the mapping alive."""
    import mmap

    import torch

    from lmc.safetensors_header import DTYPES, HeaderError, header_length, parse_header

    try:
        with open(path, "rb") as handle:  # opened once: the header and the mapping come from one open
            size = os.fstat(handle.fileno()).st_size
            raw = handle.read(header_length(handle.read(8), size))
            _, entries = parse_header(raw, size)
            # Python's mmap refuses to map an empty range: a file of only a header has no data to map.
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + len(raw) else None
    except HeaderError as exc:
        raise ArtifactError(f"{path}: not a readable safetensors file ({exc})") from None
    except FileNotFoundError:
        raise ArtifactError(f"{path}: shard file missing; was the artifact built for this tensor-parallel degree?") \
            from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read: {exc.strerror or exc}") from None
    state = {}
    for name, entry in entries.items():
        itemsize, torch_name = DTYPES[entry.dtype]
        dtype = getattr(torch, torch_name)
        if not entry.nbytes:
            state[name] = torch.empty(entry.shape, dtype=dtype)
            continue
        raw_bytes = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.end - entry.begin, offset=entry.begin)
        if entry.begin % itemsize:
            # The format does not promise alignment (lmc's writer aligns every tensor): an unaligned
            # element type cannot view the mapping, so this one tensor is copied.
            raw_bytes = raw_bytes.clone()
        state[name] = raw_bytes.view(dtype).reshape(entry.shape)
    return state


def resolve_device(device: str, rank: int):
    import torch

    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise MissingDependencyError("device 'cuda' requested but torch sees no CUDA GPU; "
                                         "run on a GPU instance or plan for the CPU")
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    raise InternalError(f"the hf engine cannot run on device {device!r}")


def build_skeleton(config, task: str, dtype):
    """The full-size model with parameters on the meta device (buffers real), in `dtype`.

    Weight initialisation is switched off (transformers' no_init_weights, as its own from_pretrained
    does before loading): every parameter comes from the shard, and running torch's init functions on
    meta tensors is not free (it goes through Python decompositions: ~0.5 s for a 1 GB Llama on a
    small CPU, per rank, at every start). Buffers (rotary frequencies) are still computed in
    __init__."""
    import torch
    import transformers

    from lmc.runtime.engines.tp import parameters_on_meta

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    if task == "text2text-generation" or getattr(config, "is_encoder_decoder", False):
        factory = transformers.AutoModelForSeq2SeqLM
    else:
        factory = transformers.AutoModelForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with parameters_on_meta(), no_init_weights():
            model = factory.from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    return model


def eos_token_ids(model_dir: Path, config, tokenizer) -> set[int]:
    """EOS as HF generate sees it: generation_config.json first, then config.json, then the tokenizer."""
    value = None
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(config, "eos_token_id", None)
    if value is None:
        value = tokenizer.eos_token_id
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple)) else {int(value)}


def _cast(tensor, dtype):
    """Floating tensors into the compute dtype (a no-op for a shard already in the plan's dtype).

    Quantized weights (int8, fp8) stay as they are: they are dequantized per matmul."""
    import torch

    if tensor.dtype in (torch.int8, torch.float8_e4m3fn) or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def load_whole(model_dir: Path, shard: Path, dtype):
    """A model lmc has no tensor-parallel layout for, served whole (TP 1): transformers' own
    from_pretrained builds it from config.json and loads the shard with its name and layout conversions
    (fused experts, renamed keys), through a folder of links (config.json, model.safetensors). Every
    parameter must come from the shard: a missing or unexpected key is an ArtifactError naming it, never
    a randomly initialised weight."""
    import tempfile

    import transformers

    if not Path(shard).is_file():
        raise ArtifactError(f"{shard}: shard file missing; was the artifact built for this tensor-parallel degree?")
    with tempfile.TemporaryDirectory(prefix="lmc-whole-") as folder:
        os.symlink(Path(model_dir, "config.json").resolve(), Path(folder, "config.json"))
        os.symlink(Path(shard).resolve(), Path(folder, "model.safetensors"))
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(key) for key in info.get(kind) or ())
        if keys:
            raise ArtifactError(f"{shard}: does not match the model config.json builds: {kind.replace('_', ' ')} "
                                f"{', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}")
    return model


class HFEngine:
    """One TP rank of a transformers model; see the Engine protocol in base.py."""

    name = "hf"

    def __init__(self, *, family: str, task: str, dtype: str, tensor_parallel_degree: int, max_sequence_length: int,
                 batch_size: int, device: str):
        self.family = family
        self.task = task
        self.dtype = dtype
        self.tp = tensor_parallel_degree
        self.max_sequence_length = max_sequence_length
        self.batch_size = batch_size
        self.device_kind = device
        self.model = None
        self.tokenizer = None
        self.loop = None
        self.rank = 0
        self.every_rank_answers = False  # see Engine.every_rank_answers
        self.compact_batches = True  # see DecodeLoop: off where the model keeps its own KV cache

    def load(self, model_dir: Path, rank: int, world_size: int) -> None:
        import torch.distributed as dist
        import transformers

        from lmc.runtime.engines.generate import DecodeLoop
        from lmc.runtime.engines.tp import apply_shard, normalise_names

        model_dir = Path(model_dir)
        if world_size != self.tp:
            raise InternalError(f"engine planned for TP {self.tp} started in a group of {world_size}")
        if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise InternalError("TP > 1 needs torch.distributed initialised before Engine.load")
        self.rank = rank
        device = resolve_device(self.device_kind, rank)
        config = transformers.AutoConfig.from_pretrained(model_dir)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        shard = model_dir / shard_path(self.tp, rank)
        if has_layout(self.family):
            state = read_shard(shard)
            compute_dtype = self._compute_dtype(state)
            state = {name: _cast(tensor, compute_dtype) for name, tensor in state.items()}
            model = build_skeleton(config, self.task, compute_dtype)
            apply_shard(model, normalise_names(state, model, self.family), family=self.family, config=config,
                        rank=rank, world_size=world_size)
        else:
            compute_dtype = self._compute_dtype({})
            model = load_whole(model_dir, shard, compute_dtype)
        model = self._finish(model, compute_dtype, device)
        self.model = model
        self.loop = DecodeLoop(model, self.tokenizer, max_sequence_length=self.max_sequence_length, device=device,
                               eos_token_ids=eos_token_ids(model_dir, config, self.tokenizer), rank=rank,
                               world_size=world_size, every_rank_answers=self.every_rank_answers,
                               compact=self.compact_batches)
        log.info("rank %d/%d loaded %s (%s) on %s", rank, world_size, self.family, self.dtype, device)

    def _compute_dtype(self, state: dict):
        """fp32/fp16/bf16 as planned. int8/fp8 weights are dequantized on the fly into fp32 on the CPU (fast
        there, and exact enough) and fp16 on a GPU."""
        import torch

        if self.dtype in TORCH_DTYPES:
            return getattr(torch, TORCH_DTYPES[self.dtype])
        if self.dtype in ("int8", "fp8"):
            return torch.float32 if self.device_kind == "cpu" else torch.float16
        raise InternalError(f"the {self.name} engine has no dtype {self.dtype!r}")

    def _finish(self, model, compute_dtype, device):
        """Hook for subclasses (deepspeed) to wrap the loaded rank-local model."""
        model.eval()
        return model.to(device)

    def generate(self, batch: list[GenerationRequest], on_token: TokenCallback | None = None,
                 cancel_probe: CancelProbe | None = None) -> list[GenerationResult]:
        if self.loop is None:
            raise InternalError("generate called before load")
        return self.loop.generate(batch, on_token, cancel_probe=cancel_probe)

    def running_batch(self, on_token: TokenCallback | None = None, block_size: int | None = None):
        """Continuous batching (see base.Engine.running_batch): the decode loop's RunningBatch."""
        if self.loop is None:
            raise InternalError("running_batch called before load")
        return self.loop.running_batch(on_token, block_size)

    def count_tokens(self, text: str) -> int:
        if self.loop is None:
            raise InternalError("count_tokens called before load")
        return self.loop.count_tokens(text)
