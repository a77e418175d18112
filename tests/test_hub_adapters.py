"""Adapters and a speculative draft named by Hub id, through the real huggingface_hub against the local Hub
stand-in (lmc.testing.hub_server, HF_ENDPOINT pointed at it): `lmc plan` reads an adapter's
adapter_config.json only (a draft's config and safetensors headers) and records the commit; `lmc build`
downloads that commit's adapter files only (the draft's checkpoint) and packs them, hashed in lmc.json."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from lmc.testing.adapters import make_lora_adapter
from lmc.testing.checkpoints import make_checkpoint
from lmc.testing.hub_server import HubStandIn

from test_hub import hf_environment

ROOT = Path(__file__).resolve().parents[1]
REPO = "acme/sql-lora"


def run_lmc(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc", *args], env=dict(env, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)


def test_a_hub_adapter_is_planned_from_its_config_and_built_from_its_files_only(tmp_path):
    checkpoint = make_checkpoint("llama", tmp_path / "ckpt", hidden_size=128, intermediate_size=256)
    repo = make_lora_adapter(checkpoint, tmp_path / "repos" / REPO, rank=8, seed=3, base_model="lmc/tiny-llama")
    (repo / "README.md").write_text("# an adapter\n")
    (repo / "optimizer.pt").write_bytes(b"\0" * 64)  # training state: never downloaded
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nid = "lmc/tiny-llama"\npath = "{checkpoint.as_posix()}"\n'
                    '[target]\ninstance = "local"\n[budget]\nmemory_per_device = "4GiB"\n'
                    '[workload]\nmax_input_tokens = 64\nmax_output_tokens = 32\nconcurrency = 2\n'
                    f'[pin]\nengine = "vllm"\n[[adapters]]\nname = "sql"\nid = "{REPO}"\n')
    with HubStandIn(tmp_path / "repos") as hub:
        env = hf_environment(tmp_path / "hf", hub.url)
        planned = run_lmc(["plan", "--json", str(spec)], env)
        assert planned.returncode == 0, planned.stderr
        adapter = json.loads(planned.stdout)["lora"]["adapters"][0]
        assert adapter["revision"] == hub.commit(REPO) and adapter["source"] == f"{REPO}@{hub.commit(REPO)}"
        assert adapter["rank"] == 8 and adapter["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
        fetched = {request[1].split("?")[0].rsplit("/", 1)[-1] for request in hub.requests if REPO in request[1]}
        assert "adapter_model.safetensors" not in fetched and "README.md" not in fetched
        hub.requests.clear()
        out = tmp_path / "artifact"
        built = run_lmc(["build", str(spec), "--format", "dir", "-o", str(out)], env)
        assert built.returncode == 0, built.stderr
        fetched = {request[1].split("?")[0].rsplit("/", 1)[-1] for request in hub.requests if REPO in request[1]}
    assert not {"README.md", "optimizer.pt"} & fetched
    files = json.loads((out / "lmc.json").read_text())["files"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        packed = out / "adapters" / "sql" / name
        assert packed.read_bytes() == (repo / name).read_bytes()
        assert files[f"adapters/sql/{name}"]["sha256"] == hashlib.sha256(packed.read_bytes()).hexdigest()
    assert sorted(p.name for p in (out / "adapters" / "sql").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]


def test_an_unknown_hub_adapter_is_one_line_on_its_key(tmp_path):
    checkpoint = make_checkpoint("llama", tmp_path / "ckpt", hidden_size=128, intermediate_size=256)
    (tmp_path / "repos").mkdir()
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nid = "lmc/tiny-llama"\npath = "{checkpoint.as_posix()}"\n'
                    '[target]\ninstance = "local"\n[pin]\nengine = "vllm"\n'
                    '[[adapters]]\nname = "sql"\nid = "acme/missing"\n')
    with HubStandIn(tmp_path / "repos") as hub:
        planned = run_lmc(["plan", str(spec)], hf_environment(tmp_path / "hf", hub.url))
    assert planned.returncode == 1
    assert planned.stderr == (f'lmc: error: {spec}:10: adapters.0.id = "acme/missing": no such repo on the Hub '
                              f"({hub.url}), or it is private: check the id, or set HF_TOKEN\n")
    assert planned.stderr.count("\n") == 1


def test_a_hub_draft_is_planned_from_its_config_and_packed_at_the_planned_commit(tmp_path):
    """A one-layer draft on the Hub beside a twelve-layer base (so that, at acceptance 0.95, the plan keeps
    speculation on at batch 1): the plan records the draft's commit; the build downloads it and packs it in
    draft/, and serving.properties points vLLM at it under LMI's model directory."""
    base = make_checkpoint("llama", tmp_path / "base", hidden_size=128, intermediate_size=256, num_hidden_layers=12)
    draft = make_checkpoint("llama", tmp_path / "repos" / "acme" / "tiny-draft", seed=1, hidden_size=128,
                            intermediate_size=256, num_hidden_layers=1)
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nid = "lmc/tiny-llama"\npath = "{base.as_posix()}"\n[target]\ninstance = "local"\n'
                    '[budget]\nmemory_per_device = "4GiB"\n[workload]\nmax_input_tokens = 64\n'
                    'max_output_tokens = 32\nconcurrency = 1\n[pin]\nengine = "vllm"\n[speculative]\n'
                    'method = "draft"\nnum_tokens = 2\nmodel = "acme/tiny-draft"\nacceptance_rate = 0.95\n')
    with HubStandIn(tmp_path / "repos") as hub:
        env = hf_environment(tmp_path / "hf", hub.url)
        planned = run_lmc(["plan", "--json", str(spec)], env)
        assert planned.returncode == 0, planned.stderr
        section = json.loads(planned.stdout)["speculative"]
        assert section["enabled"] and section["revision"] == hub.commit("acme/tiny-draft")
        assert section["vllm_method"] == "draft_model" and section["draft_bytes_per_device"] > 0
        out = tmp_path / "artifact"
        built = run_lmc(["build", str(spec), "--format", "dir", "-o", str(out)], env)
        assert built.returncode == 0, built.stderr
    files = json.loads((out / "lmc.json").read_text())["files"]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        packed = out / "draft" / name
        assert packed.read_bytes() == (draft / name).read_bytes()
        assert files[f"draft/{name}"]["sha256"] == hashlib.sha256(packed.read_bytes()).hexdigest()
    assert ('option.speculative_config={"method":"draft_model","num_speculative_tokens":2,'
            '"model":"/opt/ml/model/draft"}') in (out / "serving.properties").read_text().splitlines()
