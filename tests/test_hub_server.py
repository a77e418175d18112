"""The Hub stand-in (lmc.testing.hub_server) driven by the real huggingface_hub, unpatched.

huggingface_hub is pointed at the stand-in with `configure_huggingface_hub` (HF_ENDPOINT,
HF_HUB_CACHE, HF_HUB_OFFLINE in the environment and in `huggingface_hub.constants`, which read
them at import), and called the way lmc calls it: `HfApi()` built at call time, `hf_hub_download`
and `snapshot_download` without `endpoint=`/`cache_dir=`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import httpx2
import numpy as np
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.numpy import save_file

from lmc.testing.hub_server import HubStandIn, configure_huggingface_hub

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
TOKEN = "hf_stand_in_secret"


def _write_single(repo: Path) -> dict[str, np.ndarray]:
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps(CONFIG))
    (repo / "README.md").write_text("# tiny\n")
    tensors = {
        # 64*512*4 = 128 KiB: longer than the 100 kB first read of parse_safetensors_file_metadata
        "model.embed_tokens.weight": np.arange(64 * 512, dtype=np.float32).reshape(64, 512),
        "model.norm.weight": np.ones(64, dtype=np.float16),
    }
    save_file(tensors, str(repo / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def _write_sharded(repo: Path) -> dict[str, tuple[str, np.ndarray]]:
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps(CONFIG))
    (repo / "tokenizer_config.json").write_text("{}")
    (repo / "sub").mkdir()
    (repo / "sub" / "notes.txt").write_text("nested file\n")
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": np.zeros((256, 128), dtype=np.float32),
                                             "b.bias": np.zeros(8, dtype=np.int64)},
        "model-00002-of-00002.safetensors": {"c.weight": np.ones((4, 4), dtype=np.float16)},
    }
    weight_map, where = {}, {}
    for shard, tensors in shards.items():
        save_file(tensors, str(repo / shard))
        for name, t in tensors.items():
            weight_map[name] = shard
            where[name] = (shard, t)
    total = sum((repo / s).stat().st_size for s in shards)
    (repo / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return where


@pytest.fixture
def hub_root(tmp_path):
    root = tmp_path / "hub"
    _write_single(root / "acme" / "tiny")
    _write_sharded(root / "acme" / "sharded")
    _write_single(root / "acme" / "gated")
    return root


@pytest.fixture
def hub(hub_root, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with HubStandIn(hub_root, gated={"acme/gated": TOKEN}) as server:
        configure_huggingface_hub(monkeypatch, endpoint=server.url, cache_dir=tmp_path / "hf-cache")
        yield server


def _sent(hub, method=None, suffix=None):
    return [(m, p, h) for m, p, h in hub.requests
            if (method is None or m == method) and (suffix is None or p.split("?")[0].endswith(suffix))]


def test_configuration_points_huggingface_hub_at_the_stand_in(hub, tmp_path):
    assert hub.url.startswith("http://127.0.0.1:") and hub.cdn_url.startswith("http://127.0.0.1:")
    assert os.environ["HF_ENDPOINT"] == hub.url == constants.ENDPOINT == HfApi().endpoint
    assert constants.HF_HUB_CACHE == os.environ["HF_HUB_CACHE"] == str(tmp_path / "hf-cache")
    assert constants.is_offline_mode() is False


def test_model_info_sha_siblings_and_safetensors_summary(hub, hub_root):
    info = HfApi().model_info("acme/tiny", revision="main", files_metadata=True)
    assert info.sha == hub.commit("acme/tiny") and len(info.sha) == 40
    assert info.id == info.modelId == "acme/tiny"
    assert info.private is False and info.gated is False
    assert info.last_modified is not None and info.downloads == 0 and info.likes == 0 and "safetensors" in info.tags
    assert info.config == {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    sib = {s.rfilename: s for s in info.siblings}
    assert sorted(sib) == ["README.md", "config.json", "model.safetensors"]
    weights = (hub_root / "acme" / "tiny" / "model.safetensors").read_bytes()
    assert sib["model.safetensors"].size == len(weights)
    assert sib["model.safetensors"].lfs.sha256 == hashlib.sha256(weights).hexdigest()
    assert sib["model.safetensors"].lfs.size == len(weights)
    assert sib["config.json"].size == len(json.dumps(CONFIG)) and sib["config.json"].lfs is None
    assert info.safetensors.parameters == {"F32": 64 * 512, "F16": 64}
    assert info.safetensors.total == 64 * 512 + 64
    # pinned to the commit sha: same answer; without files_metadata, names only (as the Hub)
    pinned = HfApi().model_info("acme/tiny", revision=info.sha)
    assert pinned.sha == info.sha and all(s.size is None for s in pinned.siblings)
    sharded = HfApi().model_info("acme/sharded", files_metadata=True)
    assert sharded.safetensors.parameters == {"F32": 256 * 128, "I64": 8, "F16": 16}
    assert sharded.sha == hub.commit("acme/sharded") != info.sha


def test_hf_hub_download_plain_and_lfs_files(hub, hub_root):
    repo = hub_root / "acme" / "tiny"
    path = hf_hub_download("acme/tiny", "config.json")
    assert Path(path).read_bytes() == (repo / "config.json").read_bytes()
    assert f"snapshots/{hub.commit('acme/tiny')}/config.json" in path
    path = hf_hub_download("acme/tiny", "model.safetensors")
    assert Path(path).read_bytes() == (repo / "model.safetensors").read_bytes()
    # the LFS file: HEAD answered 302 with X-Linked-* (hf stops there), then one GET on the CDN origin
    assert [m for m, p, h in _sent(hub, suffix="model.safetensors")] == ["HEAD", "GET"]
    assert _sent(hub, "GET", "model.safetensors")[0][1].startswith("/cdn/")
    cached = hf_hub_download("acme/tiny", "config.json")  # cached: one HEAD, no GET
    assert cached == hf_hub_download("acme/tiny", "config.json", revision=hub.commit("acme/tiny"))


def test_get_safetensors_metadata_reads_only_headers(hub):
    api = HfApi()
    meta = api.get_safetensors_metadata("acme/tiny")
    assert not meta.sharded
    tensors = meta.files_metadata["model.safetensors"].tensors
    assert {n: (t.dtype, t.shape) for n, t in tensors.items()} == {
        "model.embed_tokens.weight": ("F32", [64, 512]), "model.norm.weight": ("F16", [64])}
    assert meta.files_metadata["model.safetensors"].metadata == {"format": "pt"}

    hub.requests.clear()
    meta = api.get_safetensors_metadata("acme/sharded")
    assert meta.sharded and meta.metadata["total_size"] > 0
    assert meta.weight_map == {"a.weight": "model-00001-of-00002.safetensors",
                               "b.bias": "model-00001-of-00002.safetensors",
                               "c.weight": "model-00002-of-00002.safetensors"}
    got = {n: (t.dtype, t.shape) for f in meta.files_metadata.values() for n, t in f.tensors.items()}
    assert got == {"a.weight": ("F32", [256, 128]), "b.bias": ("I64", [8]), "c.weight": ("F16", [4, 4])}
    assert meta.parameter_count == {"F32": 256 * 128, "I64": 8, "F16": 16}

    # every GET of a weights file, on the Hub or the CDN, was a range read of the header
    weight_gets = _sent(hub, "GET", ".safetensors")
    assert len(weight_gets) == 4  # per shard: resolve (302) then the CDN
    assert all(h.get("Range") == "bytes=0-100000" for _, _, h in weight_gets)
    shard1 = hub.state("acme/sharded").files["model-00001-of-00002.safetensors"]
    assert shard1.size > 100_001  # so the range read really was partial


def test_sharded_safetensors_metadata_in_one_request(hub):
    meta = HfApi().get_sharded_safetensors_metadata("acme/sharded")
    assert set(meta.files_metadata) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert meta.weight_map["c.weight"] == "model-00002-of-00002.safetensors"


def test_snapshot_download_fetches_only_allowed_files(hub, hub_root):
    folder = Path(snapshot_download("acme/sharded", allow_patterns=["*.json"]))
    assert folder.name == hub.commit("acme/sharded")
    got = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert got == ["config.json", "model.safetensors.index.json", "tokenizer_config.json"]
    assert not _sent(hub, suffix=".safetensors")  # weights never touched
    # the listing came from the tree API at the commit, after one repo_info
    assert any(p.startswith(f"/api/models/acme/sharded/tree/{folder.name}?") for _, p, _ in hub.requests)
    everything = Path(snapshot_download("acme/sharded"))
    assert (everything / "sub" / "notes.txt").read_text() == "nested file\n"
    assert (everything / "model-00002-of-00002.safetensors").read_bytes() == \
        (hub_root / "acme" / "sharded" / "model-00002-of-00002.safetensors").read_bytes()


def test_list_repo_tree_and_paths_info(hub):
    api = HfApi()
    top = {e.path: type(e).__name__ for e in api.list_repo_tree("acme/sharded")}
    assert top["sub"] == "RepoFolder" and top["config.json"] == "RepoFile" and "sub/notes.txt" not in top
    files = api.list_repo_files("acme/sharded")
    assert "sub/notes.txt" in files and "sub" not in files
    info = {e.path: e for e in api.get_paths_info("acme/sharded", ["config.json", "missing", "sub"])}
    assert sorted(info) == ["config.json", "sub"]
    lfs = next(iter(api.get_paths_info("acme/sharded", "model-00002-of-00002.safetensors")))
    assert lfs.lfs is not None and lfs.lfs.size == lfs.size


def test_gated_repo_needs_its_token(hub, hub_root, monkeypatch):
    api = HfApi()
    info = api.model_info("acme/gated")  # metadata is public on the Hub for gated repos
    assert info.gated == "auto"
    with pytest.raises(GatedRepoError) as e:
        hf_hub_download("acme/gated", "config.json")
    assert e.value.response.status_code == 401
    with pytest.raises(GatedRepoError):
        api.get_safetensors_metadata("acme/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(GatedRepoError) as e:
        hf_hub_download("acme/gated", "config.json")
    assert e.value.response.status_code == 403

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.requests.clear()
    path = hf_hub_download("acme/gated", "model.safetensors")
    assert Path(path).read_bytes() == (hub_root / "acme" / "gated" / "model.safetensors").read_bytes()
    head, get = _sent(hub, suffix="model.safetensors")
    assert head[0] == "HEAD" and head[2]["Authorization"] == f"Bearer {TOKEN}"
    assert get[1].startswith("/cdn/") and "Authorization" not in get[2]  # never sent off the Hub's origin
    assert "F32" in HfApi().get_safetensors_metadata("acme/gated").parameter_count


def test_error_mapping(hub):
    api = HfApi()
    with pytest.raises(RepositoryNotFoundError) as e:
        api.model_info("acme/nope")
    assert type(e.value) is RepositoryNotFoundError and e.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError) as e:
        hf_hub_download("acme/nope", "config.json")
    assert type(e.value) is RepositoryNotFoundError
    with pytest.raises(RepositoryNotFoundError) as e:
        api.model_info("acme/nope", token="hf_any")
    assert e.value.response.status_code == 404

    with pytest.raises(RevisionNotFoundError):
        api.model_info("acme/tiny", revision="v2")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("acme/tiny", "config.json", revision="0" * 40)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("acme/tiny", revision="dev")

    with pytest.raises(RemoteEntryNotFoundError) as e:
        hf_hub_download("acme/tiny", "tokenizer.json")
    assert isinstance(e.value, EntryNotFoundError)
    assert e.value.response.headers["X-Repo-Commit"] == hub.commit("acme/tiny")
    assert not api.file_exists("acme/tiny", "tokenizer.json") and api.file_exists("acme/tiny", "config.json")
    with pytest.raises(HfHubHTTPError):
        api.list_repo_refs("acme/tiny")  # a route the stand-in does not serve: a plain 404


def test_revision_changes_when_files_change(hub, hub_root):
    api = HfApi()
    before = hub.commit("acme/tiny")
    old = Path(hf_hub_download("acme/tiny", "config.json", revision=before)).read_text()
    (hub_root / "acme" / "tiny" / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 128}))
    after = hub.commit("acme/tiny")
    assert after != before and api.model_info("acme/tiny").sha == after
    with pytest.raises(RevisionNotFoundError):
        api.model_info("acme/tiny", revision=before)
    new = Path(hf_hub_download("acme/tiny", "config.json")).read_text()
    assert json.loads(new)["hidden_size"] == 128 and json.loads(old)["hidden_size"] == 64
    # the commit-pinned copy stays in the cache: asking for the old sha needs no network
    hub.requests.clear()
    assert json.loads(Path(hf_hub_download("acme/tiny", "config.json", revision=before)).read_text()) == CONFIG
    assert hub.requests == []


def test_server_down(hub):
    api = HfApi()
    cached = hf_hub_download("acme/tiny", "config.json")
    snapshot = snapshot_download("acme/tiny", allow_patterns=["*.json"])
    hub.set_down(True)
    with pytest.raises(httpx2.ConnectError):
        api.model_info("acme/tiny")
    assert hf_hub_download("acme/tiny", "config.json") == cached  # HEAD refused: falls back to the cache
    assert snapshot_download("acme/tiny", allow_patterns=["*.json"]) == snapshot
    hub.set_down(True, status=503)
    with pytest.raises(HfHubHTTPError) as e:
        api.model_info("acme/tiny")
    assert e.value.response.status_code == 503
    hub.set_down(False)
    assert api.model_info("acme/tiny").sha == hub.commit("acme/tiny")


def test_offline_uses_the_cache(hub, tmp_path, monkeypatch):
    cached = hf_hub_download("acme/tiny", "config.json")
    weights = hf_hub_download("acme/tiny", "model.safetensors")
    configure_huggingface_hub(monkeypatch, endpoint=hub.url, cache_dir=tmp_path / "hf-cache", offline=True)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.is_offline_mode()
    hub.requests.clear()
    assert hf_hub_download("acme/tiny", "config.json") == cached
    assert hf_hub_download("acme/tiny", "model.safetensors") == weights
    with pytest.raises(LocalEntryNotFoundError):
        hf_hub_download("acme/tiny", "README.md")  # never fetched
    assert hub.requests == []  # nothing left the process
    # local_files_only=True is the per-call equivalent, with the offline switch off again
    configure_huggingface_hub(monkeypatch, endpoint=hub.url, cache_dir=tmp_path / "hf-cache")
    assert hf_hub_download("acme/tiny", "config.json", local_files_only=True) == cached
    assert hub.requests == []


def test_range_requests(hub, hub_root):
    body = (hub_root / "acme" / "tiny" / "config.json").read_bytes()
    url = f"{hub.url}/acme/tiny/resolve/main/config.json"

    def get(rng):
        req = urllib.request.Request(url, headers={"Range": rng})
        with urllib.request.urlopen(req) as r:
            return r.status, r.headers, r.read()

    status, headers, got = get("bytes=2-5")
    assert (status, got, headers["Content-Range"]) == (206, body[2:6], f"bytes 2-5/{len(body)}")
    assert headers["X-Repo-Commit"] == hub.commit("acme/tiny")
    assert get("bytes=10-")[2] == body[10:]  # how http_get resumes
    assert get("bytes=-3")[2] == body[-3:]
    with pytest.raises(urllib.error.HTTPError) as e:
        get(f"bytes={len(body)}-")
    e.value.close()
    assert e.value.code == 416 and e.value.headers["Content-Range"] == f"bytes */{len(body)}"
    assert ("GET", "/acme/tiny/resolve/main/config.json", {"Range": "bytes=2-5"}) in hub.requests


def test_subprocess_reads_the_environment(hub, tmp_path):
    # A fresh interpreter needs only the environment variables (read when huggingface_hub is imported).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = ("import huggingface_hub as h; print(h.hf_hub_download('acme/tiny', 'config.json'));"
            "print(h.HfApi().model_info('acme/tiny').sha)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    path, sha = out.stdout.split()
    assert path.startswith(str(tmp_path / "hf-cache")) and json.loads(Path(path).read_text()) == CONFIG
    assert sha == hub.commit("acme/tiny")
