"""The chain a model's facts come from (lmc/model_sources.py): model.path, then the Hub, then the HF cache,
then the catalog; the first that answers gives the facts, read once per plan. Driven through the real
huggingface_hub against the local Hub stand-in (HF_ENDPOINT), in a subprocess with the user's environment
variables, as test_hub.py does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.planner import catalog
from lmc.testing.checkpoints import make_checkpoint
from lmc.testing.hub_server import HubStandIn
from test_hub import hf_environment, lmc_plan, spec_file

QWEN = "Qwen/Qwen3-8B"  # in the catalog; the stand-in serves a tiny qwen3 under the same id
NOWHERE = "http://127.0.0.1:9"  # nothing listens there: the Hub cannot be reached


def facts_of(model_id: str, hf_home: Path, endpoint: str, *, path: Path | None = None,
             revision: str | None = None, offline: bool = False) -> dict:
    """The chain's facts for the model, or {"error": its one line}, in a process with this HF setup."""
    env = hf_environment(hf_home, endpoint)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    code = ("import json, sys; from pathlib import Path\n"
            "from lmc.errors import LmcError\n"
            "from lmc.model_sources import Wanted, read_model_facts\n"
            "model_id, revision, path = json.loads(sys.argv[1])\n"
            "try:\n"
            "    facts = read_model_facts(Wanted(model_id, revision, Path(path) if path else None))\n"
            "except LmcError as exc:\n"
            "    print(json.dumps({'error': str(exc)})); sys.exit(0)\n"
            "print(facts.model_dump_json())\n"
            "assert 'torch' not in sys.modules\n")
    argument = json.dumps([model_id, revision, str(path) if path else None])
    result = subprocess.run([sys.executable, "-c", code, argument], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repos")
    make_checkpoint("qwen3", root / QWEN)
    return root


@pytest.fixture
def hub(repos):
    with HubStandIn(repos) as server:
        yield server


def test_a_path_beats_the_hub(hub, tmp_path):
    local = make_checkpoint("llama", tmp_path / "local")
    facts = facts_of(QWEN, tmp_path / "hf", hub.url, path=local)
    assert facts["source"] == str(local)
    assert facts["architecture"] == "LlamaForCausalLM"
    assert facts["revision"] is None
    assert hub.requests == []  # the Hub was never asked


def test_the_hub_beats_the_catalog_and_the_hf_cache_beats_it_offline(hub, tmp_path):
    online = facts_of(QWEN, tmp_path / "hf", hub.url)
    commit = hub.commit(QWEN)
    assert online["source"] == f"Hub {QWEN}@{commit} (config.json and the safetensors metadata of 1 file(s))"
    assert online["revision"] == commit
    assert online["layers"] == 2 and online["parameters"] < catalog.model_facts(QWEN).parameters / 1000
    hub.set_down(True)
    offline = facts_of(QWEN, tmp_path / "hf", hub.url, offline=True)
    assert offline == online  # from the HF cache and lmc's summary of the commit, not from the catalog


def test_a_hub_that_cannot_answer_falls_to_the_catalog_and_says_why(tmp_path):
    published = catalog.model_facts(QWEN)
    down = facts_of(QWEN, tmp_path / "hf", NOWHERE)
    assert down["source"].startswith(f"{published.source} (the Hub was not used: cannot reach the Hub at {NOWHERE} (")
    assert {**down, "source": published.source} == published.model_dump(mode="json")
    empty = facts_of(QWEN, tmp_path / "hf", NOWHERE, offline=True)
    assert empty["source"].startswith(f"{published.source} (the Hub was not used: HF_HUB_OFFLINE is set and the "
                                      "HF cache (")
    # The catalog holds no revisions, nor ids it does not know: the Hub's reason is the error then.
    pinned = facts_of(QWEN, tmp_path / "hf", NOWHERE, revision="v1")
    assert pinned["error"].startswith(f"model.id = {QWEN!r}: cannot reach the Hub at {NOWHERE} (")
    unknown = facts_of("acme/not-in-the-catalog", tmp_path / "hf", NOWHERE)
    assert unknown["error"].startswith(f"model.id = 'acme/not-in-the-catalog': cannot reach the Hub at {NOWHERE} (")


def test_one_plan_asks_the_hub_once(hub, tmp_path):
    spec = spec_file(tmp_path, QWEN)
    spec.write_text(spec.read_text().replace("max_input_tokens = 1024", "max_input_tokens = 128")
                    .replace("max_output_tokens = 256", "max_output_tokens = 64"))
    result = lmc_plan(spec, hub, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"]["revision"] == hub.commit(QWEN)
    model_info = [r for r in hub.requests if r[1].split("?")[0] == f"/api/models/{QWEN}"]
    config = [r for r in hub.requests if r[0] == "GET" and r[1].split("?")[0].endswith("/config.json")]
    assert len(model_info) == 1 and len(config) == 1, hub.requests


def test_a_draft_model_is_read_by_the_same_chain(tmp_path, capsys):
    from lmc.cli.main import main

    make_checkpoint("llama", tmp_path / "base")
    make_checkpoint("llama", tmp_path / "draft", seed=1)
    spec = tmp_path / "spec.toml"
    spec.write_text('[model]\nid = "acme/tiny"\npath = "base"\n[target]\ninstance = "ml.g6e.xlarge"\n'
                    '[workload]\nmax_input_tokens = 128\nmax_output_tokens = 64\n[pin]\nengine = "vllm"\n'
                    '[speculative]\nmethod = "draft"\nmodel = "draft"\nnum_tokens = 2\n')
    assert main(["plan", "--json", str(spec)]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["speculative"]["model"] == "draft" and body["speculative"]["draft_bytes_per_device"] > 0
    # An error in the draft's directory is final (no Hub, no catalog after it), on the spec's key.
    config = tmp_path / "draft" / "config.json"
    text = config.read_text()
    config.write_text("{")
    assert main(["plan", str(spec)]) == 1
    assert capsys.readouterr().err.startswith(f'lmc: error: {spec}:13: speculative.model = "draft": {config}: '
                                              "not valid JSON (")
    config.write_text(text)
    (tmp_path / "draft" / "tokenizer.json").write_text("{}")
    assert main(["plan", str(spec)]) == 1
    assert capsys.readouterr().err == (f'lmc: error: {spec}:13: speculative.model = "draft": its tokenizer.json '
                                       "differs from the base's: a proposer needs the base's tokenizer\n")
