"""`lmc plan` of a Hub id through the real huggingface_hub against the local Hub stand-in
(lmc.testing.hub_server, HF_ENDPOINT pointed at it): online, from the HF cache offline, and every
failure as one line. Each plan runs `lmc` in a subprocess with the user's environment variables, as a
user runs it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.planner import catalog
from lmc.planner.architecture import facts_from_config
from lmc.testing.hub_server import HubStandIn

QWEN = "Qwen/Qwen3-8B"
TOKEN = "hf_stand_in_token"
ST_SIZES = {"BF16": 2, "F32": 4}


def published_config(model_id: str) -> dict:
    path = catalog._model_index()[model_id.lower()][1]
    return json.loads((path / "config.json").read_text())


def transformers_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensor names and shapes, as transformers builds the model (meta device)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    return sorted((name, tuple(t.shape)) for name, t in model.state_dict().items())


def write_header_only(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: str) -> None:
    """A safetensors file whose header is a real checkpoint's and whose data is absent: what
    get_safetensors_metadata reads (a range request on the header) is exact, at a few KB."""
    header, offset = {}, 0
    for name, shape in tensors:
        size = ST_SIZES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body)


@pytest.fixture(scope="module")
def qwen_tensors():
    return transformers_tensors(published_config(QWEN))


def make_repo(root: Path, model_id: str, config: dict, tensors, *, shards: int = 2) -> None:
    repo = root / model_id
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps(config, indent=2))
    (repo / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    (repo / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    per = -(-len(tensors) // shards)
    weight_map = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = tensors[index * per:(index + 1) * per]
        write_header_only(repo / name, part, "BF16")
        weight_map.update({tensor: name for tensor, _ in part})
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def spec_file(tmp_path: Path, model_id: str, *, revision: str | None = None, instance: str = "ml.g5.2xlarge") -> Path:
    lines = ["[model]", f'id = "{model_id}"']
    if revision:
        lines.append(f'revision = "{revision}"')
    lines += ["[target]", f'instance = "{instance}"', "[workload]", "max_input_tokens = 1024",
              "max_output_tokens = 256", "concurrency = 4"]
    path = tmp_path / "spec.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def hf_environment(hf_home: Path, endpoint: str) -> dict[str, str]:
    """This process's environment without the user's (or the test run's) Hugging Face settings, pointed
    at `endpoint` with `hf_home` as HF_HOME."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("HF_", "HUGGING")) and key != "TRANSFORMERS_OFFLINE"}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint)
    return env


def lmc_plan(spec: Path, hub: HubStandIn | None, hf_home: Path, *, offline: bool = False,
             token: str | None = None, endpoint: str | None = None) -> subprocess.CompletedProcess:
    env = hf_environment(hf_home, endpoint or (hub.url if hub else "http://127.0.0.1:9"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    code = ("import sys; from lmc.cli.main import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'lmc plan imported torch'; sys.exit(code)")
    return subprocess.run([sys.executable, "-c", code, "plan", "--json", str(spec)], env=env,
                          capture_output=True, text=True, timeout=120)


def safetensors_requests(hub: HubStandIn) -> list[tuple[str, str, dict]]:
    return [r for r in hub.requests if r[1].split("?")[0].endswith(".safetensors")]


@pytest.fixture
def hub(tmp_path, qwen_tensors):
    root = tmp_path / "repos"
    make_repo(root, QWEN, published_config(QWEN), qwen_tensors)
    tiny = dict(published_config(QWEN), hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=1024)
    make_repo(root, "acme/gated-model", tiny, transformers_tensors(tiny), shards=1)
    with HubStandIn(root, gated={"acme/gated-model": TOKEN}) as server:
        yield server


def test_plan_of_a_hub_id_reads_config_and_headers_only(hub, tmp_path, qwen_tensors):
    result = lmc_plan(spec_file(tmp_path, QWEN), hub, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    exact = sum(_count(shape) for _, shape in qwen_tensors)
    assert plan["model"]["revision"] == hub.commit(QWEN)
    assert plan["model"]["parameters"] == exact
    assert plan["model"]["architecture"] == "Qwen3ForCausalLM"
    assert plan["model"]["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2  # 36 layers, 8 kv heads of 128, bf16
    # The weights were never downloaded: only the headers, by range requests.
    reads = safetensors_requests(hub)
    assert reads and all(r[0] == "HEAD" or "Range" in r[2] for r in reads), reads
    # The summary lmc keeps per commit, so the next plan reads no header again.
    summary = tmp_path / "hf" / "lmc" / "safetensors" / "Qwen--Qwen3-8B" / f"{hub.commit(QWEN)}.json"
    assert summary.is_file()
    hub.requests.clear()
    again = lmc_plan(spec_file(tmp_path, QWEN), hub, tmp_path / "hf")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["model"] == plan["model"]
    assert safetensors_requests(hub) == []


def test_offline_plans_from_the_hf_cache(hub, tmp_path):
    online = lmc_plan(spec_file(tmp_path, QWEN), hub, tmp_path / "hf")
    assert online.returncode == 0, online.stderr
    hub.set_down(True)
    offline = lmc_plan(spec_file(tmp_path, QWEN), None, tmp_path / "hf", offline=True)
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["model"] == json.loads(online.stdout)["model"]
    # With config.json cached but no weights metadata, the weights are computed from the config.
    for summary in (tmp_path / "hf" / "lmc" / "safetensors").rglob("*.json"):
        summary.unlink()
    computed = lmc_plan(spec_file(tmp_path, QWEN), None, tmp_path / "hf", offline=True)
    assert computed.returncode == 0, computed.stderr
    model = json.loads(computed.stdout)["model"]
    assert model["revision"] == hub.commit(QWEN)
    assert model["parameters"] == facts_from_config(published_config(QWEN), QWEN, source="t").parameters


def test_a_pinned_revision_is_the_commit_the_plan_records(hub, tmp_path):
    commit = hub.commit(QWEN)
    result = lmc_plan(spec_file(tmp_path, QWEN, revision=commit), hub, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"]["revision"] == commit
    bad = lmc_plan(spec_file(tmp_path, QWEN, revision="v9"), hub, tmp_path / "hf")
    assert bad.returncode == 1
    assert one_line(bad.stderr).endswith(':3: model.revision = "v9": no such revision of Qwen/Qwen3-8B on the Hub '
                                         "(a branch, tag or commit)")


def test_gated_repo_needs_hf_token(hub, tmp_path):
    refused = lmc_plan(spec_file(tmp_path, "acme/gated-model"), hub, tmp_path / "hf")
    assert refused.returncode == 1
    line = one_line(refused.stderr)
    assert f"a gated repo: accept its terms at {hub.url}/acme/gated-model and set HF_TOKEN" in line
    allowed = lmc_plan(spec_file(tmp_path, "acme/gated-model"), hub, tmp_path / "hf", token=TOKEN)
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["model"]["revision"] == hub.commit("acme/gated-model")


def test_unknown_repo_offline_without_cache_and_hub_down_are_one_line(hub, tmp_path):
    unknown = lmc_plan(spec_file(tmp_path, "acme/no-such-model"), hub, tmp_path / "hf")
    assert unknown.returncode == 1
    assert "no such model on the Hub" in one_line(unknown.stderr)
    empty = lmc_plan(spec_file(tmp_path, "acme/no-such-model"), hub, tmp_path / "empty", offline=True)
    assert empty.returncode == 1
    assert "HF_HUB_OFFLINE is set and the HF cache" in one_line(empty.stderr)
    hub.set_down(True)
    down = lmc_plan(spec_file(tmp_path, "acme/gated-model"), hub, tmp_path / "hf2")
    assert down.returncode == 1
    assert f"cannot reach the Hub at {hub.url}" in one_line(down.stderr)


def test_a_catalog_id_plans_from_the_catalog_when_the_hub_cannot_answer(tmp_path):
    # No Hub (nothing listens on the endpoint) and nothing cached: the built-in published config.
    result = lmc_plan(spec_file(tmp_path, QWEN), None, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)["model"]
    assert model["revision"] is None
    assert model["parameters"] == catalog.model_facts(QWEN).parameters


@pytest.mark.parametrize("damage, message", [
    ("header", "the Hub repo's safetensors headers at {commit} cannot be read, a corrupt checkpoint"),
    ("shard", "model.safetensors.index.json at {commit} names a file the repo does not have, a corrupt checkpoint"),
    ("index", "the Hub repo's safetensors headers at {commit} cannot be read, a corrupt checkpoint"),
    (None, None),
])
def test_a_corrupt_hub_checkpoint_is_one_line_and_a_sound_one_plans_quietly(tmp_path, damage, message):
    """huggingface_hub's own parsing errors (SafetensorsParsingError, a JSON or type error on the index) crashed
    the plan (exit 70), a shard the index names but the repo lacks was called 'no config.json', and its bar
    ("Parse safetensors files") printed on stderr around every plan of a sharded repo. Found by serving corrupt
    repos from the stand-in."""
    tiny = dict(published_config(QWEN), hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=1024)
    root = tmp_path / "repos"
    make_repo(root, "acme/tiny", tiny, transformers_tensors(tiny), shards=2)
    repo = root / "acme" / "tiny"
    if damage == "header":
        (repo / "model-00002-of-00002.safetensors").write_bytes(struct.pack("<Q", 8) + b"notjson!")
    elif damage == "shard":
        (repo / "model-00002-of-00002.safetensors").unlink()
    elif damage == "index":
        (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["not", "a", "map"]}))
    with HubStandIn(root) as server:
        result = lmc_plan(spec_file(tmp_path, "acme/tiny"), server, tmp_path / "hf")
        commit = server.commit("acme/tiny")
    if damage is None:
        assert result.returncode == 0 and "Parse safetensors files" not in result.stderr, result.stderr
        return
    assert result.returncode == 1
    assert f'model.id = "acme/tiny": {message.format(commit=commit)}' in one_line(result.stderr)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _count(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


# --- lmc build of a Hub id ---------------------------------------------------------------------------

def tiny_repo(root: Path) -> Path:
    """A tiny real qwen3 checkpoint as a Hub repo, with files a build must not fetch beside it."""
    from lmc.testing.checkpoints import make_checkpoint

    repo = make_checkpoint("qwen3", root / "acme" / "tiny-qwen3")
    (repo / "README.md").write_text("# tiny\n")
    (repo / "optimizer.pt").write_bytes(b"\x80\x04not weights")
    (repo / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    return repo


def tiny_spec(tmp_path: Path) -> Path:
    profile = Path(__file__).resolve().parents[1] / "specs" / "profiles" / "cpu-2core.toml"
    path = tmp_path / "tiny.toml"
    path.write_text(f"""[model]
id = "acme/tiny-qwen3"
[target]
instance = "local"
profile = "{profile.as_posix()}"
[budget]
memory_per_device = "4GiB"
[workload]
max_input_tokens = 64
max_output_tokens = 32
[pin]
engine = "hf"
dtype = "fp32"
""")
    return path


def lmc_cli(args: list[str], hub: HubStandIn, hf_home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc", *args], env=hf_environment(hf_home, hub.url),
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])


def reviewed_plan(hub: HubStandIn, tmp_path: Path) -> dict:
    """`lmc plan --json` of the tiny spec, kept as tmp_path/plan.json (what `lmc build --plan` takes)."""
    plan = lmc_cli(["plan", "--json", str(tiny_spec(tmp_path))], hub, tmp_path / "hf")
    assert plan.returncode == 0, plan.stderr
    (tmp_path / "plan.json").write_text(plan.stdout)
    return json.loads(plan.stdout)


def test_build_downloads_only_what_it_needs_and_packs_it(tmp_path):
    from safetensors.numpy import load_file

    repo = tiny_repo(tmp_path / "repos")
    with HubStandIn(tmp_path / "repos") as hub:
        plan = reviewed_plan(hub, tmp_path)
        built = lmc_cli(["build", str(tiny_spec(tmp_path)), "--format", "dir", "-o", str(tmp_path / "art"),
                         "--plan", str(tmp_path / "plan.json")], hub, tmp_path / "hf")
        assert built.returncode == 0, built.stderr
        fetched = {r[1].split("?")[0].rsplit("/", 1)[-1] for r in hub.requests if "/resolve/" in r[1]}
    assert "model.safetensors" in fetched and "tokenizer.json" in fetched
    assert not fetched & {"README.md", "optimizer.pt", "pytorch_model.bin"}, fetched
    packed = load_file(str(tmp_path / "art" / "shards" / "tp1" / "rank0.safetensors"))
    original = load_file(str(repo / "model.safetensors"))
    assert sorted(packed) == sorted(original)
    assert all((packed[name] == original[name]).all() for name in original)
    manifest = json.loads((tmp_path / "art" / "lmc.json").read_text())
    assert manifest["plan"]["model"]["revision"] == plan["model"]["revision"]


def test_build_refuses_a_revision_that_moved_and_weights_that_differ(tmp_path):
    repo = tiny_repo(tmp_path / "repos")
    with HubStandIn(tmp_path / "repos") as hub:
        reviewed_plan(hub, tmp_path)
        before = hub.commit("acme/tiny-qwen3")
        (repo / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))  # a new commit on main
        after = hub.commit("acme/tiny-qwen3")
        moved = lmc_cli(["build", str(tiny_spec(tmp_path)), "-o", str(tmp_path / "a.tar.gz"),
                         "--plan", str(tmp_path / "plan.json")], hub, tmp_path / "hf")
        assert moved.returncode == 1
        assert one_line(moved.stderr) == (f"lmc: error: model.revision: the reviewed plan read acme/tiny-qwen3 at {before}; "
                                          f"the Hub now serves {after} for this spec: plan again and review, or pin "
                                          f'model.revision = "{before}"')
        assert not (tmp_path / "a.tar.gz").exists()
        # The metadata the plan read (lmc's per-commit summary) no longer matches the weights: refused.
        summary = tmp_path / "hf" / "lmc" / "safetensors" / "acme--tiny-qwen3" / f"{after}.json"
        replan = lmc_cli(["plan", "--json", str(tiny_spec(tmp_path))], hub, tmp_path / "hf")
        assert replan.returncode == 0 and summary.is_file(), replan.stderr
        body = json.loads(summary.read_text())
        body["files"]["model.safetensors"][0][2][0] += 1
        summary.write_text(json.dumps(body))
        differs = lmc_cli(["build", str(tiny_spec(tmp_path)), "-o", str(tmp_path / "b.tar.gz")], hub, tmp_path / "hf")
        assert differs.returncode == 1
        assert "differs from the safetensors metadata the plan read" in one_line(differs.stderr)
        assert not (tmp_path / "b.tar.gz").exists()


def test_a_repo_with_pickle_weights_only_plans_from_its_config(tmp_path):
    root = tmp_path / "repos"
    repo = root / "acme" / "bin-only"
    repo.mkdir(parents=True)
    config = dict(published_config(QWEN), num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)
    (repo / "config.json").write_text(json.dumps(config))
    (repo / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with HubStandIn(root) as hub:
        result = lmc_plan(spec_file(tmp_path, "acme/bin-only"), hub, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)["model"]
    assert model["parameters"] == facts_from_config(config, "x", source="t").parameters
    assert model["revision"] == hub.commit("acme/bin-only")
