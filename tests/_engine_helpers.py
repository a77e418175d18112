"""Tiny random checkpoints and pre-partitioned artifacts for the engine tests (no hub, seconds to build)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from lmc.runtime.workers import free_port  # noqa: F401 (the tests' free port, imported from here)

# Weights drawn wider than transformers' defaults, so greedy decoding of a random model does not
# collapse onto one token (and a wrong split shows up in the tokens, not only in the logits).
WIDE_INIT = {"opt": {"init_std": 0.2}, "t5": {"initializer_factor": 4.0}}


def make_checkpoint(family: str, out_dir: Path, *, seed: int = 0, vocab_size: int = 384, **overrides) -> Path:
    """lmc.testing's tiny checkpoint of `family`, with wide initial weights."""
    from lmc.testing import make_checkpoint as make_tiny

    init = WIDE_INIT.get(family, {"initializer_range": 0.2})
    return make_tiny(family, out_dir, seed=seed, vocab_size=vocab_size, **{**init, **overrides})


def build_artifact(checkpoint: Path, out_dir: Path, tp: int, dtype: str = "fp32") -> Path:
    """An artifact tree for `checkpoint` at TP `tp`: its config and tokenizer files, and the rank
    shards written by the build's own partitioner (lmc.emitters.partition)."""
    from lmc.emitters.checkpoint import validate_checkpoint
    from lmc.emitters.partition import partition_checkpoint
    from lmc.planner.checkpoint_facts import checkpoint_model_facts

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, out_dir / item.name)
    facts = checkpoint_model_facts(checkpoint, "test/model")
    info = validate_checkpoint(checkpoint, facts)
    partition_checkpoint(info, family=facts.family, dtype=dtype, tp=tp, head_dim=facts.head_dim,
                         kv_heads=facts.kv_heads, out_dir=out_dir, progress=False)
    return out_dir


def hf_greedy(checkpoint: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """Reference: HF generate on the unpartitioned checkpoint, greedy, generated ids without EOS/padding."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    config = tf.AutoConfig.from_pretrained(checkpoint)
    cls = tf.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tf.AutoModelForCausalLM
    model = cls.from_pretrained(checkpoint, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    ids = out[0].tolist() if config.is_encoder_decoder else out[0, inputs["input_ids"].shape[1]:].tolist()
    if config.is_encoder_decoder:
        ids = ids[1:]  # the decoder start token
    result = []
    for token in ids:
        if token == config.eos_token_id:
            break
        result.append(token)
    return result


def logits_at_every_position(model, tokenizer, family: str, prompt: str):
    """Logits at every position of `prompt` (a T5 decoder fed four tokens): the whole forward, not just
    the argmax of the last step, so a wrongly sliced head, bias or ALiBi slope shows."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        if family == "t5":
            return model(input_ids=ids, decoder_input_ids=torch.tensor([[0, 5, 6, 7]])).logits[0].float()
        return model(input_ids=ids).logits[0].float()


def hf_logits(checkpoint: Path, family: str, prompt: str):
    """Reference: logits_at_every_position of transformers' own model on the unpartitioned checkpoint."""
    import transformers as tf

    cls = tf.AutoModelForSeq2SeqLM if family == "t5" else tf.AutoModelForCausalLM
    return logits_at_every_position(cls.from_pretrained(checkpoint, dtype=torch.float32).eval(),
                                    tf.AutoTokenizer.from_pretrained(checkpoint), family, prompt)


def run_tp_ranks(target, *args, world_size: int = 2, timeout_s: float = 240) -> dict[int, object]:
    """Spawn `world_size` processes joined over gloo; each calls `target(rank, opened, *args)` and
    the returned dict is what that rank reported. `opened` lists every *.safetensors path the rank
    opened through open() (an audit hook sees them); the target may clear it between loads."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_entry, args=(target, rank, world_size, port, args, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=timeout_s) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert [p.exitcode for p in processes] == [0] * world_size, f"rank exit codes {[p.exitcode for p in processes]}"
    return results


def _rank_entry(target, rank: int, world_size: int, port: int, args: tuple, queue) -> None:
    import os
    import sys

    import torch.distributed as dist

    from lmc.runtime.engines.tp import exit_rank, leave_process_group

    torch.set_num_threads(1)
    opened: list[str] = []

    def audit(event, event_args):
        if event == "open" and isinstance(event_args[0], str) and event_args[0].endswith(".safetensors"):
            opened.append(event_args[0])

    sys.addaudithook(audit)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))  # DeepSpeed reads the environment too
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out: dict = {}
    try:
        out = target(rank, opened, *args)
    except BaseException:
        queue.put((rank, out))
        leave_process_group()
        raise  # a non-zero exit code, which run_tp_ranks reports
    queue.put((rank, out))
    queue.close()
    queue.join_thread()  # the report is in the pipe before the process ends
    exit_rank()
