"""transformers' own continuous batching (`generate_batch`, `paged|sdpa` attention) against lmc's
RunningBatch (engines/generate.py), on one random Llama, 32 greedy sequences of 32 new tokens, same run.

Why lmc does not adopt transformers' manager: measured here, it is far slower on this CPU (docs/measurements.md, the transformers_cb_bench row).
Usage: python bench/transformers_cb_bench.py [HIDDEN=256] [THREADS=1]
"""
import sys, time, tempfile, torch
from pathlib import Path
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from _engine_helpers import build_artifact
from lmc.testing.checkpoints import make_checkpoint
from lmc.runtime.engines.hf import HFEngine
from lmc.runtime.engines.base import GenerationParams, GenerationRequest
import transformers as tf
hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 256
tmp = Path(tempfile.mkdtemp())
ck = make_checkpoint("llama", tmp / "ck", hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=384)
N, NEW = 32, 32
tok = tf.AutoTokenizer.from_pretrained(ck)
prompts = [f"request {i}: the quick brown fox jumps" for i in range(N)]
ids = [tok(p)["input_ids"] for p in prompts]
model = tf.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="paged|sdpa").eval()
print("parameters", sum(p.numel() for p in model.parameters()))
cfg = tf.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
model.generate_batch(ids[:4], generation_config=cfg)  # warm-up
t = time.perf_counter(); out = model.generate_batch(ids, generation_config=cfg); tcb = time.perf_counter() - t
cb_tokens = sum(len(o.generated_tokens) for o in out.values())
art = build_artifact(ck, tmp / "a", 1)
e = HFEngine(family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=1, max_sequence_length=128, batch_size=32, device="cpu")
e.load(art, 0, 1)
reqs = [GenerationRequest(id=f"r{i}", prompt=p, params=GenerationParams(max_new_tokens=NEW, ignore_eos=True)) for i, p in enumerate(prompts)]
e.generate(reqs[:4])
b = e.running_batch()
t = time.perf_counter()
with torch.inference_mode():
    b.join(reqs)
    while len(b):
        b.step()
tl = time.perf_counter() - t
print(f"transformers generate_batch (paged|sdpa): {cb_tokens} tokens in {tcb:.2f}s = {cb_tokens/tcb:.0f} tok/s")
print(f"lmc RunningBatch: {N*NEW} tokens in {tl:.2f}s = {N*NEW/tl:.0f} tok/s  ratio lmc/transformers {(N*NEW/tl)/(cb_tokens/tcb):.1f}x")
