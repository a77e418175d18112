"""End to end: `lmc build` a tiny random checkpoint, serve it with the runtime (real hf engine in
spawned TP worker processes over gloo), and compare greedy output with HF `generate` on the
unpartitioned checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from lmc.cli.main import main  # noqa: E402
from lmc.runtime.server import Runtime  # noqa: E402
from lmc.runtime.startup import open_artifact  # noqa: E402
from lmc.runtime.workers import AUDIT_ENV  # noqa: E402
from _engine_helpers import hf_greedy  # noqa: E402
from runtime_fakes import ServerThread  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["the quick brown fox", "Hello, world! How are you"]
NEW_TOKENS = 8

SPEC = """\
[model]
id = "tiny/{family}"
path = "{path}"

[target]
instance = "local"
profile = "cpu2.toml"

[workload]
max_input_tokens = 32
max_output_tokens = 16
concurrency = 4

[pin]
engine = "hf"
dtype = "fp32"
tensor_parallel_degree = {tp}
replicas = {replicas}
"""
# `local` is the whole CPU as one device; TP ranks on a CPU are processes, so describe two devices.
CPU_PROFILE = 'base = "local"\ndevices = 2\ndevice_memory_bytes = "8GiB"\n'


def build(tmp_path: Path, family: str, tp: int, replicas: int = 1) -> tuple[Path, Path]:
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint(family, tmp_path / "ckpt")
    (tmp_path / "cpu2.toml").write_text(CPU_PROFILE)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(family=family, path=checkpoint.as_posix(), tp=tp, replicas=replicas))
    out = tmp_path / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    return checkpoint, out


def hf_reference(checkpoint: Path, prompts: list[str], max_new_tokens: int) -> list[tuple[str, int]]:
    """HF generate, greedy, on the unpartitioned checkpoint: (decoded new text, new token count) each."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    answers = [hf_greedy(checkpoint, prompt, max_new_tokens) for prompt in prompts]
    return [(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), len(ids))
            for ids in answers]


def serve_and_compare(checkpoint: Path, artifact_dir: Path, worker_env: dict | None = None) -> dict:
    artifact = open_artifact(artifact_dir)
    runtime = Runtime(artifact.model_dir, artifact.plan, request_timeout_s=120, worker_env=worker_env)
    with ServerThread(runtime) as server:
        server.wait_ready(180)
        batch = httpx.post(server.url + "/invocations", timeout=120,
                           json={"inputs": PROMPTS, "parameters": {"max_new_tokens": NEW_TOKENS}})
        assert batch.status_code == 200, batch.text
        streamed = httpx.post(server.url + "/invocations", timeout=120,
                              json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": NEW_TOKENS, "details": True},
                                    "stream": True})
        lines = [json.loads(line) for line in streamed.text.splitlines()]
        detailed = httpx.post(server.url + "/invocations", timeout=120,
                              json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}})
    tokens = detailed.json()["details"]["tokens"]  # LMI: one {id, text, log_prob} per generated token
    assert [token["id"] for token in tokens] == hf_greedy(checkpoint, PROMPTS[0], NEW_TOKENS)
    assert all(isinstance(token["text"], str) and token["log_prob"] <= 0 for token in tokens)
    reference = hf_reference(checkpoint, PROMPTS, NEW_TOKENS)
    assert [answer["generated_text"] for answer in batch.json()] == [text for text, _ in reference]
    text, count = reference[0]
    # LMI's shape: every line a token (id, text, log-probability), the last one also the text and details
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"] == text
    assert all(isinstance(line["token"]["id"], int) and line["token"]["log_prob"] <= 0 for line in lines)
    assert lines[-1]["details"]["generated_tokens"] == count
    return artifact.plan


def test_llama_gqa_at_tp2_matches_hf_and_each_rank_reads_only_its_shard(tmp_path):
    checkpoint, artifact = build(tmp_path, "llama", tp=2)
    audit = tmp_path / "audit" / "opens"
    audit.parent.mkdir()
    plan = serve_and_compare(checkpoint, artifact, worker_env={AUDIT_ENV: str(audit)})
    assert plan["tensor_parallel_degree"] == 2 and plan["model"]["kv_heads"] < plan["model"]["attention_heads"]
    opened = {log.name.split(".")[1]: log.read_text().splitlines() for log in audit.parent.iterdir()}
    assert set(opened) == {"g0r0", "g0r1"}
    for rank in (0, 1):
        shards = {Path(p).name for p in opened[f"g0r{rank}"] if p.endswith(".safetensors")}
        assert shards == {f"rank{rank}.safetensors"}, shards


def test_llama_tp1_with_two_replicas_matches_hf(tmp_path):
    checkpoint, artifact = build(tmp_path, "llama", tp=1, replicas=2)
    plan = serve_and_compare(checkpoint, artifact)
    assert (plan["tensor_parallel_degree"], plan["replicas"]) == (1, 2)


def test_gpt_neox_at_tp2_matches_hf(tmp_path):
    checkpoint, artifact = build(tmp_path, "gpt_neox", tp=2)
    serve_and_compare(checkpoint, artifact)


# One DJL MPI-mode rank: loads the artifact's generated model.py as DJL's Python engine would, warms it
# up, answers a batch and a stream, and writes what it answered to argv[2] (a format string for its rank).
_DJL_RANK = r"""
import importlib.util, json, os, sys
artifact, out, bodies, stream_body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])


class Input:  # the part of djl_python.inputs.Input the handler uses
    def __init__(self, body=None, batches=None):
        self.body, self.batches = body, batches

    def is_empty(self):
        return self.body is None and not self.batches

    def get_properties(self):
        return {"model_dir": artifact}

    def get_batches(self):
        return self.batches if self.batches is not None else [self]

    def get_as_json(self):
        return self.body


spec = importlib.util.spec_from_file_location("model", os.path.join(artifact, "model.py"))
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)
assert model.handle(Input()) is None
batch = model.handle(Input(batches=[Input(body) for body in bodies]))
stream = model.handle(Input(batches=[Input(stream_body)]))
lines = [json.loads(line) for line in stream.stream_content]
with open(out.format(os.environ["RANK"]), "w") as f:
    json.dump({"batch": {str(k): json.loads(v) for k, v in batch.content.items()}, "stream": lines,
               "stream_content_type": stream.properties.get("content-type")}, f)
"""


def test_the_generated_model_py_serves_under_djl_mpi_mode_at_tp2_as_hf_generates(tmp_path):
    """What a stock LMI container does with the artifact (option.entryPoint=model.py, one process per TP
    rank, torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR): same answers as HF generate, details
    listing the tokens, and a stream of LMI jsonlines, from every rank (DJL returns the last rank's
    answer; passive workers are off)."""
    import os
    import subprocess
    import sys

    from runtime_fakes import free_port

    checkpoint, artifact = build(tmp_path, "llama", tp=2)
    params = {"max_new_tokens": NEW_TOKENS}
    bodies = [{"inputs": PROMPTS, "parameters": params}, {"inputs": PROMPTS[0], "parameters": {**params, "details": True}}]
    stream_body = {"inputs": PROMPTS[1], "parameters": {**params, "details": True}, "stream": True}
    out = tmp_path / "rank{}.json"
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH")])))
    ranks = [subprocess.Popen([sys.executable, "-c", _DJL_RANK, str(artifact), str(out), json.dumps(bodies),
                               json.dumps(stream_body)], env=dict(env, RANK=str(rank)), stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    for rank in ranks:
        _, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err[-3000:]
    answers = [json.loads(Path(str(out).format(rank)).read_text()) for rank in range(2)]
    assert answers[0] == answers[1]
    answered = answers[1]
    reference = hf_reference(checkpoint, PROMPTS, NEW_TOKENS)
    assert answered["batch"]["0"] == [{"generated_text": text} for text, _ in reference]
    detailed = answered["batch"]["1"]
    assert detailed["generated_text"] == reference[0][0]
    tokens = detailed["details"]["tokens"]
    assert [token["id"] for token in tokens] == hf_greedy(checkpoint, PROMPTS[0], NEW_TOKENS)
    assert "".join(token["text"] for token in tokens) == reference[0][0]
    assert all(token["log_prob"] <= 0 for token in tokens)
    lines = answered["stream"]
    assert answered["stream_content_type"] == "application/jsonlines"
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"] == reference[1][0]
    assert lines[-1]["details"] == {"finish_reason": "length", "generated_tokens": reference[1][1], "inputs": PROMPTS[1]}
    assert all("generated_text" not in line for line in lines[:-1]) and len(lines) > 1


GPU_SPEC = """\
[model]
id = "tiny/llama"
path = "{path}"

[target]
instance = "ml.g5.xlarge"

[workload]
max_input_tokens = 32
max_output_tokens = 16
concurrency = 2

[pin]
engine = "hf"
dtype = "fp32"
tensor_parallel_degree = 1
"""


@pytest.mark.gpu
def test_llama_on_one_gpu_matches_hf(tmp_path):
    """The same path on CUDA: the worker is pinned with CUDA_VISIBLE_DEVICES and loads on cuda:0."""
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    spec = tmp_path / "spec.toml"
    spec.write_text(GPU_SPEC.format(path=checkpoint.as_posix()))
    out = tmp_path / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    plan = serve_and_compare(checkpoint, out)
    assert plan["target"]["accelerator"] == "a10g"


CONCURRENT_PROMPTS = ["the quick brown fox", "Hello, world! How are you", "a", "once upon a time there was",
                      "1 2 3 4 5 6 7 8", "The cat sat on", "lmc compiles deployments", "?"]


def test_64_concurrent_clients_get_the_reference_answers(tmp_path):
    """64 clients at once against the real engine (TP 2, dynamic batching): no errors, and every
    greedy answer equals HF generate on the unpartitioned checkpoint for its prompt."""
    import asyncio

    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    (tmp_path / "cpu2.toml").write_text(CPU_PROFILE)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(family="llama", path=checkpoint.as_posix(), tp=2, replicas=1)
                    .replace("concurrency = 4", "concurrency = 64"))
    out = tmp_path / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    artifact = open_artifact(out)
    assert artifact.plan["job_queue_size"] >= 64 and artifact.plan["batch_size"] > 1

    async def ask_all(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(
                client.post(url + "/invocations", json={"inputs": CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)],
                                                        "parameters": {"max_new_tokens": 6}})
                for i in range(64)))

    runtime = Runtime(artifact.model_dir, artifact.plan, request_timeout_s=300)
    with ServerThread(runtime) as server:
        server.wait_ready(180)
        answers = asyncio.run(ask_all(server.url))
        metrics = httpx.get(server.url + "/metrics").text
    assert [a.status_code for a in answers] == [200] * 64, [a.text for a in answers if a.status_code != 200][:3]
    reference = [text for text, _ in hf_reference(checkpoint, CONCURRENT_PROMPTS, 6)]
    for i, answer in enumerate(answers):
        assert answer.json()["generated_text"] == reference[i % len(CONCURRENT_PROMPTS)], i
    batches = [line for line in metrics.splitlines() if line.startswith("lmc_batch_size_count")]
    assert batches and float(batches[0].split()[-1]) < 64, "requests were batched, not served one by one"


BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_chat_prompts_get_one_bos_as_apply_chat_template_gives(tmp_path):
    """A Llama-style tokenizer adds BOS itself and the chat template writes it too: a chat prompt must be
    tokenized without special tokens (one BOS, as apply_chat_template(tokenize=True) and vLLM give),
    a completion prompt with them. The answer equals HF generate on apply_chat_template's ids."""
    import openai
    import transformers as tf
    from tokenizers import Tokenizer, processors

    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    tokenizer_file = checkpoint / "tokenizer.json"
    fast = Tokenizer.from_file(str(tokenizer_file))
    bos = fast.token_to_id("<s>")
    fast.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast.save(str(tokenizer_file))
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=BOS_TEMPLATE)))
    (tmp_path / "cpu2.toml").write_text(CPU_PROFILE)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(family="llama", path=checkpoint.as_posix(), tp=1, replicas=1))
    assert main(["build", str(spec), "--format", "dir", "-o", str(tmp_path / "artifact")]) == 0

    messages = [{"role": "user", "content": "the quick brown fox"}]
    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert ids[:2] != [bos, bos] and ids[0] == bos and tokenizer("x").input_ids[0] == bos
    model = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    artifact = open_artifact(tmp_path / "artifact")
    with ServerThread(Runtime(artifact.model_dir, artifact.plan, request_timeout_s=120, sampling_defaults={})) as server:
        server.wait_ready(180)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="tiny/llama", messages=messages, max_tokens=6, temperature=0)
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        completion = client.completions.create(model="tiny/llama", prompt=rendered, max_tokens=1, temperature=0)
        # logit_bias reaches the engine: a +100 bias on one token makes greedy choose it every step
        forced = tokenizer("quick", add_special_tokens=False).input_ids[0]
        biased = client.completions.create(model="tiny/llama", prompt="hello", max_tokens=3, temperature=0,
                                           logit_bias={str(forced): 100})
        scored = client.completions.create(model="tiny/llama", prompt="the quick brown fox", max_tokens=3, temperature=0,
                                           logprobs=2)
        chat_scored = client.chat.completions.create(model="tiny/llama", messages=messages, max_tokens=3, temperature=0,
                                                     logprobs=True, top_logprobs=2)
        # streamed, the chunks carry the same logprobs, each with the tokens its text covers
        scored_chunks = [c.choices[0] for c in client.completions.create(
            model="tiny/llama", prompt="the quick brown fox", max_tokens=3, temperature=0, logprobs=2, stream=True)]
        chat_chunks = [c.choices[0] for c in client.chat.completions.create(
            model="tiny/llama", messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2, stream=True)]
    assert biased.choices[0].text == tokenizer.decode([forced] * 3, clean_up_tokenization_spaces=False) != ""

    def reference(prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        """HF greedy ids and each one's log-probability from HF's own forward."""
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=3, do_sample=False, pad_token_id=0)
        new = out[0, len(prompt_ids):].tolist()
        with torch.no_grad():
            log_probs = torch.log_softmax(model(out).logits[0].float(), -1)
        return new, [float(log_probs[len(prompt_ids) - 1 + i, token]) for i, token in enumerate(new)]

    new, values = reference(tokenizer("the quick brown fox").input_ids)
    logprobs = scored.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([token]) for token in new]
    assert logprobs.token_logprobs == pytest.approx(values, abs=1e-4)
    for chosen, value, top in zip(logprobs.tokens, values, logprobs.top_logprobs):
        assert len(top) == 2 and top[chosen] == pytest.approx(value, abs=1e-4) == max(top.values())  # greedy
    streamed = [chunk.logprobs for chunk in scored_chunks if chunk.logprobs is not None]
    assert "".join(chunk.text for chunk in scored_chunks) == scored.choices[0].text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [item for part in streamed for item in getattr(part, key)] == getattr(logprobs, key)
    new, values = reference(ids)
    content = chat_scored.choices[0].logprobs.content
    assert [item for chunk in chat_chunks if chunk.logprobs for item in chunk.logprobs.content] == content
    assert [item.logprob for item in content] == pytest.approx(values, abs=1e-4)
    assert [len(item.top_logprobs) for item in content] == [2, 2, 2]
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == expected
    assert completion.usage.prompt_tokens == len(ids) + 1  # a completion prompt gets the tokenizer's BOS too
