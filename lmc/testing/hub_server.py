"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests that drive the real `huggingface_hub`.

`HubStandIn(root)` serves the model repos found under `root/<org>/<name>/` (every file below that
folder, sub-folders included) with the routes, headers and status codes that `huggingface_hub`
2.4.0 (the version the venv installs; HTTP through `httpx2`) uses, as read from its source:

* `GET /api/models/{repo}` and `GET /api/models/{repo}/revision/{rev}` (`HfApi.model_info`,
  `repo_info`, the first call of `snapshot_download`). With `?blobs=true` (`files_metadata=True`)
  each sibling carries `size`, `blobId` and, for LFS files, `lfs: {sha256, size, pointerSize}`;
  without it siblings carry only `rfilename`, as on the Hub. The JSON also has `id`, `modelId`,
  `author`, `sha`, `lastModified`, `createdAt`, `private: false`, `disabled: false`,
  `gated: false | "auto"`, `downloads`, `likes`, `tags`, `library_name`, `config` (`architectures`,
  `model_type` from config.json), `usedStorage` and, when the repo has safetensors weights,
  `safetensors: {"parameters": {dtype: count}, "total": count}` counted from the file headers
  (the shards named by model.safetensors.index.json if there is one, else every *.safetensors).
* `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=..&expand=..` (`list_repo_tree`,
  `list_repo_files`; `snapshot_download` lists the files to fetch HERE, not from the siblings:
  `repo_info` for the commit, then the recursive tree at that commit, then one `hf_hub_download`
  per file matching `allow_patterns`/`ignore_patterns`, pinned to the commit).
* `POST /api/models/{repo}/paths-info/{rev}` (`get_paths_info`).
* `GET /api/models/{repo}/safetensors-metadata/{index}` (`get_sharded_safetensors_metadata`:
  every shard header in one answer; main only, like the Hub).
* `HEAD`/`GET /{repo}/resolve/{rev}/{path}` (`hf_hub_download`, `file_exists`,
  `parse_safetensors_file_metadata`). Plain files answer 200 with `ETag` (the quoted git blob
  sha1), `X-Repo-Commit`, `Content-Length`, `Accept-Ranges: bytes`. LFS files (the suffixes in
  `LFS_SUFFIXES`, *.safetensors among them) answer what the Hub answers: `302` to a "CDN" with
  `X-Repo-Commit`, `X-Linked-Etag` (the quoted sha256), `X-Linked-Size` and `Location`. The CDN is
  a second listener on 127.0.0.1 (another port, so another origin): `huggingface_hub` stops at the
  302 for a HEAD and reads the metadata from it, then GETs the CDN url WITHOUT the Authorization
  header (httpx drops it on a cross-origin redirect; hf_hub_download pops it), as with the Hub.
* `Range: bytes=a-b | a- | -n` on a resolve or CDN GET: 206 with `Content-Range`; past the end:
  416 with `Content-Range: bytes */size`. (`parse_safetensors_file_metadata` reads
  `bytes=0-100000` and, for a longer header, `bytes=8-{n+7}`; `http_get` resumes with
  `bytes={done}-` after a connection error mid-body.)

Errors are what `huggingface_hub.utils.hf_raise_for_status` maps (`X-Error-Code` first, then
`X-Error-Message`; a GET error also carries `{"error": message}`):

* unknown repo: 401 without an Authorization header, 404 with one (as the Hub), both with
  `X-Error-Code: RepoNotFound` -> `RepositoryNotFoundError`. The code is needed: the client's
  "401 means repo not found" fallback only matches `https://` urls, so a bare 401 from this
  http:// server would be a plain `HfHubHTTPError`.
* gated repo (`gated={repo_id: token}`), resolve routes only: no token -> 401, another token ->
  403, both `X-Error-Code: GatedRepo` -> `GatedRepoError`, which SUBCLASSES
  `RepositoryNotFoundError` (catch it first). As on the Hub, the /api/ metadata routes of a gated
  repo answer without a token (model_info shows `gated == "auto"`); only file contents are gated.
* revision other than `main` or the current commit -> 404 `RevisionNotFound` ->
  `RevisionNotFoundError`.
* missing file -> 404 `EntryNotFound` with `X-Repo-Commit` -> `RemoteEntryNotFoundError`
  (subclass of `EntryNotFoundError` and `HfHubHTTPError`); hf_hub_download then records the
  absence under `.no_exist/<commit>/` in the cache.
* `set_down(True)`: both listeners close, connections are refused -> `httpx2.ConnectError` from
  `HfApi.model_info` (raised as is: model_info has no retry and no wrapping). `hf_hub_download`
  falls back to the cache when its HEAD fails (returns the cached file at once); with nothing
  cached it retries 5 times with backoff (1+2+4+8+8 s) and then raises `LocalEntryNotFoundError`.
  `snapshot_download` likewise returns a cached snapshot. `set_down(True, status=503)` answers
  503 instead (model_info -> `HfHubHTTPError` with status 503; hf's retried calls back off).

Commits: each repo has one commit, the sha1 of its file names and contents, recomputed on every
request (contents are re-hashed when a file's stat changes, or while it is too recent to trust
its mtime), so a test that rewrites a file sees a new `sha` and the old one answers
RevisionNotFound (the Hub would still serve an old commit; this stand-in serves only the current
files). `commit(repo_id)` gives the current sha.

`requests` records `(method, path, headers)` for every request served, CDN ones included: `path`
is the raw request target with its query string (e.g. `/api/models/o/n/revision/main?blobs=true`,
`/o/n/resolve/main/model.safetensors`, `/cdn/<sha256>/model.safetensors`); `headers` holds
`Range` and `Authorization` when sent. One request is answered (404) but NOT recorded:
`GET /api/agent-harnesses`, which huggingface_hub sends once per process, the first time it
builds its User-Agent (AI-agent detection, utils/_detect_agent.py), so whichever test calls it
first would otherwise see one more request. (A 404 also keeps huggingface_hub from caching the
answer in HF_HOME/.agent_harnesses.json.)

Making huggingface_hub use the stand-in in-process
--------------------------------------------------
`huggingface_hub.constants` reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE (or
TRANSFORMERS_OFFLINE) once, at import; `monkeypatch.setenv` after that changes nothing. And
passing `endpoint=`/`cache_dir=` is not enough: `HfApi.get_safetensors_metadata` downloads a
sharded repo's index with `cache_dir=None` (the import-time cache), `hf_hub_url` builds urls from
`constants.HUGGINGFACE_CO_URL_TEMPLATE`, and the module-level functions
(`huggingface_hub.model_info`, `get_safetensors_metadata`, ...) are bound methods of an `HfApi`
built at import, whose endpoint never changes. The approach chosen:

* lmc code calls `huggingface_hub` as a production process would: `HfApi()` built at call time
  (never the module-level `huggingface_hub.model_info`/`get_safetensors_metadata`/...), and
  `hf_hub_download`/`snapshot_download` without `endpoint=`/`cache_dir=`.
* tests call `configure_huggingface_hub(monkeypatch, endpoint=hub.url, cache_dir=...)` (below):
  it sets the environment variables (for subprocesses) AND the matching `huggingface_hub.constants`
  attributes (configuration read at call time; no behaviour is patched). The conftest's
  HF_HUB_OFFLINE=1 is turned off by it unless `offline=True`.
* a subprocess started with HF_ENDPOINT/HF_HUB_CACHE in its environment needs nothing else.

Never binds anything but 127.0.0.1. Standard library only (huggingface_hub is imported lazily
by `configure_huggingface_hub` alone).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

HOST = "127.0.0.1"
# Stored with git-LFS semantics (302 to the CDN, lfs metadata): the Hub's default .gitattributes.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".npz")
RECORDED_HEADERS = ("Range", "Authorization")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_RANGE_RE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", re.IGNORECASE)
_RACY_SECONDS = 2.0  # a file modified less than this before it was hashed is re-hashed (git's racy-clean rule)
_CHUNK = 1 << 20
_AGENT_HARNESSES = "/api/agent-harnesses"  # huggingface_hub's once-per-process agent registry fetch: not recorded


# --------------------------------------------------------------------------- repo state


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo as the stand-in serves it."""

    path: str  # relative to the repo folder, '/'-separated
    abspath: Path
    size: int
    sha256: str
    git_oid: str  # git blob sha1 of what git stores: the content, or the LFS pointer
    lfs: bool
    pointer_size: int | None
    mtime: float


@dataclass(frozen=True)
class RepoState:
    repo_id: str
    commit: str
    files: dict[str, RepoFile]  # sorted by path

    @property
    def last_modified(self) -> float:
        return max((f.mtime for f in self.files.values()), default=0.0)


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(ts * 1000) % 1000:03d}Z"


def _read_safetensors_header(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
        return header if isinstance(header, dict) else None
    except (OSError, ValueError, struct.error):
        return None


class _Hasher:
    """sha256 and git sha1 of files, cached by stat while the mtime is old enough to trust."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[tuple[int, int, int, int], float, str, str]] = {}

    def digests(self, path: Path, st: os.stat_result) -> tuple[str, str]:
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        with self._lock:
            hit = self._cache.get(path)
        if hit is not None and hit[0] == key and hit[1] - st.st_mtime > _RACY_SECONDS:
            return hit[2], hit[3]
        hashed_at = time.time()
        sha256 = hashlib.sha256()
        git = hashlib.sha1(b"blob %d\0" % st.st_size)
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha256.update(chunk)
                git.update(chunk)
        out = (sha256.hexdigest(), git.hexdigest())
        with self._lock:
            self._cache[path] = (key, hashed_at, *out)
        return out


# --------------------------------------------------------------------------- the server


class HubStandIn:
    """Serves repos from a folder: root/<org>/<name>/<files...>. Each repo has one commit: sha1 of its
    file names+contents (40 hex). See the module docstring for the routes and the error mapping."""

    def __init__(self, root: Path, *, gated: dict[str, str] | None = None):
        self.root = Path(root)
        self.gated: dict[str, str] = dict(gated or {})
        self.requests: list[tuple[str, str, dict]] = []
        self._hasher = _Hasher()
        self._blobs: dict[str, Path] = {}  # sha256 -> file, for the CDN
        self._lock = threading.Lock()
        self._down_status: int | None = None
        self._api = _Listener(self, cdn=False)
        self._cdn = _Listener(self, cdn=True)
        self._running = False

    # -- lifecycle

    def __enter__(self) -> "HubStandIn":
        self._api.start(0)
        self._cdn.start(0)
        self._running = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._api.stop()
        self._cdn.stop()

    @property
    def url(self) -> str:
        """What HF_ENDPOINT is set to: http://127.0.0.1:PORT (no trailing slash)."""
        return f"http://{HOST}:{self._api.port}"

    @property
    def cdn_url(self) -> str:
        """Where LFS files are redirected to (another port: another origin, like the Hub's CDN)."""
        return f"http://{HOST}:{self._cdn.port}"

    def set_down(self, down: bool, *, status: int | None = None) -> None:
        """Simulate the Hub unreachable. `down=True` closes both listeners (connections refused:
        httpx2.ConnectError); with `status=503` (or another code) they stay up and answer that status
        to every request instead. `down=False` serves again on the same ports."""
        if not self._running:
            raise RuntimeError("HubStandIn is not started (use it as a context manager)")
        if down and status is not None:
            self._down_status = status
            self._api.start(self._api.port)
            self._cdn.start(self._cdn.port)
        elif down:
            self._down_status = None
            self._api.stop()
            self._cdn.stop()
        else:
            self._down_status = None
            self._api.start(self._api.port)
            self._cdn.start(self._cdn.port)

    # -- repos

    def commit(self, repo_id: str) -> str:
        """The current commit sha of a repo (KeyError if root has no such repo)."""
        state = self.state(repo_id)
        if state is None:
            raise KeyError(repo_id)
        return state.commit

    def state(self, repo_id: str) -> RepoState | None:
        """The repo's files and commit as of now, or None if there is no such repo."""
        parts = repo_id.split("/")
        if len(parts) != 2 or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            return None
        folder = self.root / parts[0] / parts[1]
        if not folder.is_dir():
            return None
        files: dict[str, RepoFile] = {}
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            for name in sorted(filenames):
                abspath = Path(dirpath) / name
                try:
                    st = abspath.stat()
                    sha256, git_sha1 = self._hasher.digests(abspath, st)
                except FileNotFoundError:  # removed by the test meanwhile
                    continue
                rel = abspath.relative_to(folder).as_posix()
                lfs = rel.endswith(LFS_SUFFIXES)
                pointer = _lfs_pointer(sha256, st.st_size) if lfs else None
                files[rel] = RepoFile(
                    path=rel, abspath=abspath, size=st.st_size, sha256=sha256,
                    git_oid=_git_blob_sha1(pointer) if pointer is not None else git_sha1,
                    lfs=lfs, pointer_size=len(pointer) if pointer is not None else None, mtime=st.st_mtime,
                )
        files = dict(sorted(files.items()))
        commit = hashlib.sha1()
        for f in files.values():
            commit.update(f"{f.path}\0{f.sha256}\n".encode())
        with self._lock:
            for f in files.values():
                if f.lfs:
                    self._blobs[f.sha256] = f.abspath
        return RepoState(repo_id=repo_id, commit=commit.hexdigest(), files=files)

    def _blob(self, sha256: str) -> Path | None:
        with self._lock:
            path = self._blobs.get(sha256)
        try:
            if path is None or self._hasher.digests(path, path.stat())[0] != sha256:
                return None  # never seen, or rewritten since: that blob is gone
        except OSError:
            return None
        return path

    # -- JSON bodies

    def model_info_json(self, state: RepoState, *, blobs: bool) -> dict[str, Any]:
        repo_id = state.repo_id
        config: dict[str, Any] = {}
        cfg = state.files.get("config.json")
        if cfg is not None:
            try:
                raw = json.loads(cfg.abspath.read_bytes())
                config = {k: raw[k] for k in ("architectures", "model_type") if k in raw}
            except (OSError, ValueError):
                pass
        siblings = []
        for f in state.files.values():
            sib: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sib.update(blobId=f.git_oid, size=f.size)
                if f.lfs:
                    sib["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
            siblings.append(sib)
        tags = []
        if cfg is not None:
            tags.append("transformers")
        if any(p.endswith(".safetensors") for p in state.files):
            tags.append("safetensors")
        if config.get("model_type"):
            tags.append(config["model_type"])
        tags.append("region:us")
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": state.commit,
            "lastModified": _iso(state.last_modified),
            "createdAt": _iso(min((f.mtime for f in state.files.values()), default=0.0)),
            "private": False,
            "disabled": False,
            "gated": "auto" if repo_id in self.gated else False,
            "downloads": 0,
            "likes": 0,
            "tags": tags,
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(f.size for f in state.files.values()),
        }
        if cfg is not None:
            info["library_name"] = "transformers"
            info["config"] = config
        summary = self.safetensors_summary(state)
        if summary is not None:
            info["safetensors"] = summary
        return info

    def safetensors_files(self, state: RepoState) -> list[RepoFile]:
        index = state.files.get("model.safetensors.index.json")
        if index is not None:
            try:
                weight_map = json.loads(index.abspath.read_bytes()).get("weight_map", {})
                return [state.files[n] for n in sorted(set(weight_map.values())) if n in state.files]
            except (OSError, ValueError, AttributeError):
                return []
        return [f for f in state.files.values() if f.path.endswith(".safetensors")]

    def safetensors_summary(self, state: RepoState) -> dict[str, Any] | None:
        files = self.safetensors_files(state)
        if not files:
            return None
        params: dict[str, int] = {}
        for f in files:
            header = _read_safetensors_header(f.abspath) or {}
            for name, t in header.items():
                if name == "__metadata__" or not isinstance(t, dict):
                    continue
                count = 1
                for d in t.get("shape", []):
                    count *= int(d)
                params[t.get("dtype", "?")] = params.get(t.get("dtype", "?"), 0) + count
        return {"parameters": params, "total": sum(params.values())}

    def tree_entries(self, state: RepoState, *, expand: bool) -> dict[str, dict[str, Any]]:
        """Every file and folder of the repo as the tree API lists them, by path."""
        entries: dict[str, dict[str, Any]] = {}
        folders: dict[str, list[str]] = {}
        for f in state.files.values():
            e: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
            if f.lfs:
                e["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
            entries[f.path] = e
            parts = f.path.split("/")
            for i in range(1, len(parts)):
                folders.setdefault("/".join(parts[:i]), []).append(f"{f.path}\0{f.git_oid}")
        for folder, content in folders.items():
            oid = hashlib.sha1("\n".join(sorted(content)).encode()).hexdigest()
            entries[folder] = {"type": "directory", "oid": oid, "size": 0, "path": folder}
        if expand:
            last = {"id": state.commit, "title": "Stand-in commit", "date": _iso(state.last_modified)}
            for e in entries.values():
                e["lastCommit"] = last
        return dict(sorted(entries.items()))


class _Listener:
    """One ThreadingHTTPServer on 127.0.0.1 in a daemon thread; restartable on the same port."""

    def __init__(self, hub: HubStandIn, *, cdn: bool):
        self.hub, self.cdn = hub, cdn
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, port: int) -> None:
        if self._server is not None:
            return
        server = ThreadingHTTPServer((HOST, port), _Handler)
        server.daemon_threads = True
        server.hub = self.hub  # type: ignore[attr-defined]
        server.cdn = self.cdn  # type: ignore[attr-defined]
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"hub-stand-in-{'cdn' if self.cdn else 'api'}-{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # every answer says Connection: close (nothing pooled across set_down)
    server_version = "HubStandIn/1"

    @property
    def hub(self) -> HubStandIn:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr
        pass

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    # -- plumbing

    def _dispatch(self) -> None:
        self.close_connection = True
        if self.path.split("?")[0] == _AGENT_HARNESSES:
            return self._send(404, {"X-Error-Message": "Not served by the stand-in"})
        headers = {h: self.headers[h] for h in RECORDED_HEADERS if self.headers.get(h) is not None}
        self.hub.requests.append((self.command, self.path, headers))
        body = b""
        if self.command == "POST":
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if self.hub._down_status is not None:
                raise _HubError(self.hub._down_status, None, "The Hub stand-in is down")
            if self.server.cdn:  # type: ignore[attr-defined]
                self._cdn()
            else:
                self._route(body)
        except _HubError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug or a file removed mid-request: say so rather than drop the connection
            self._error(_HubError(500, None, f"Hub stand-in error: {type(e).__name__}: {e}"))

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, {"Content-Type": "application/json; charset=utf-8", **(headers or {})},
                   json.dumps(obj).encode())

    def _error(self, e: _HubError) -> None:
        headers = {"X-Error-Message": e.message}
        if e.code is not None:
            headers["X-Error-Code"] = e.code
        if e.commit is not None:
            headers["X-Repo-Commit"] = e.commit
        try:
            self._json({"error": e.message}, e.status, headers)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None

    # -- routing

    def _route(self, body: bytes) -> None:
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        segs = [unquote(s) for s in split.path.split("/")[1:]]
        if len(segs) >= 3 and segs[0] == "api" and segs[1] == "models":
            if len(segs) < 4:
                raise _HubError(404, None, "Not Found: the stand-in serves <org>/<name> repos only")
            repo_id, rest = f"{segs[2]}/{segs[3]}", segs[4:]
            state = self._repo(repo_id)
            if not rest and self.command == "GET":
                return self._model_info(state, "main", query)
            if len(rest) == 2 and rest[0] == "revision" and self.command == "GET":
                return self._model_info(state, rest[1], query)
            if len(rest) >= 2 and rest[0] == "tree" and self.command == "GET":
                return self._tree(state, rest[1], "/".join(rest[2:]), query)
            if len(rest) == 2 and rest[0] == "paths-info" and self.command == "POST":
                return self._paths_info(state, rest[1], body)
            if len(rest) >= 2 and rest[0] == "safetensors-metadata" and self.command == "GET":
                return self._sharded_metadata(state, "/".join(rest[1:]))
        elif len(segs) >= 5 and segs[2] == "resolve" and self.command in ("GET", "HEAD"):
            repo_id = f"{segs[0]}/{segs[1]}"
            state = self._repo(repo_id)
            self._check_gate(repo_id)
            return self._resolve(state, segs[3], "/".join(segs[4:]))
        raise _HubError(404, None, f"Not Found: the stand-in has no route {self.command} {split.path}")

    def _repo(self, repo_id: str) -> RepoState:
        state = self.hub.state(repo_id)
        if state is None:
            # The Hub answers 401 to an anonymous request for a repo it cannot show, 404 to an authenticated one.
            status = 404 if self.headers.get("Authorization") else 401
            raise _HubError(status, "RepoNotFound", "Repository not found")
        return state

    def _check_gate(self, repo_id: str) -> None:
        wanted = self.hub.gated.get(repo_id)
        if wanted is None:
            return
        token = self._token()
        if token == wanted:
            return
        status = 401 if token is None else 403
        raise _HubError(status, "GatedRepo",
                        f"Access to model {repo_id} is restricted. You must have access to it and be authenticated "
                        "to access it. Please log in.")

    def _check_revision(self, state: RepoState, revision: str) -> None:
        if revision not in ("main", state.commit):
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    # -- API routes

    def _model_info(self, state: RepoState, revision: str, query: dict[str, list[str]]) -> None:
        self._check_revision(state, revision)
        blobs = (query.get("blobs") or ["false"])[-1].lower() in ("1", "true")
        self._json(self.hub.model_info_json(state, blobs=blobs))

    def _tree(self, state: RepoState, revision: str, path: str, query: dict[str, list[str]]) -> None:
        self._check_revision(state, revision)
        recursive = (query.get("recursive") or ["false"])[-1].lower() in ("1", "true")
        expand = (query.get("expand") or ["false"])[-1].lower() in ("1", "true")
        entries = self.hub.tree_entries(state, expand=expand)
        path = path.strip("/")
        if path and entries.get(path, {}).get("type") != "directory":
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"", state.commit)
        prefix = f"{path}/" if path else ""
        out = [e for p, e in entries.items()
               if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])]
        self._json(out)

    def _paths_info(self, state: RepoState, revision: str, body: bytes) -> None:
        self._check_revision(state, revision)
        form = parse_qs(body.decode(), keep_blank_values=True)
        expand = (form.get("expand") or ["false"])[-1].lower() in ("1", "true")
        entries = self.hub.tree_entries(state, expand=expand)
        self._json([entries[p.strip("/")] for p in form.get("paths", []) if p.strip("/") in entries])

    def _sharded_metadata(self, state: RepoState, filename: str) -> None:
        index = state.files.get(filename)
        if index is None:
            raise _HubError(404, "EntryNotFound", f"{filename} does not exist on \"main\"", state.commit)
        try:
            index_json = json.loads(index.abspath.read_bytes())
        except ValueError as e:
            raise _HubError(400, None, f"{filename} is not valid JSON") from e
        headers = {}
        for shard in sorted(set(index_json.get("weight_map", {}).values())):
            f = state.files.get(shard)
            header = _read_safetensors_header(f.abspath) if f is not None else None
            if header is None:
                raise _HubError(404, "EntryNotFound", f"{shard} is missing or not a safetensors file", state.commit)
            headers[shard] = header
        self._json({"index": index_json, "headers": headers})

    # -- files

    def _resolve(self, state: RepoState, revision: str, path: str) -> None:
        self._check_revision(state, revision)
        f = state.files.get(path)
        if f is None:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"", state.commit)
        base = {"X-Repo-Commit": state.commit, "Accept-Ranges": "bytes"}
        if f.lfs:
            location = f"{self.hub.cdn_url}/cdn/{f.sha256}/{quote(f.path)}"
            self._send(302, {**base, "Location": location, "ETag": f'"{f.git_oid}"',
                             "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size),
                             "Content-Type": "text/plain; charset=utf-8"})
            return
        self._file(f.abspath, f.size, {**base, "ETag": f'"{f.git_oid}"'}, f.path)

    def _cdn(self) -> None:
        segs = [unquote(s) for s in urlsplit(self.path).path.split("/")[1:]]
        if self.command not in ("GET", "HEAD") or len(segs) < 3 or segs[0] != "cdn":
            raise _HubError(404, None, "Not Found")
        blob = self.hub._blob(segs[1])
        if blob is None:
            raise _HubError(404, None, "NoSuchKey: the blob is not (or no longer) stored")
        self._file(blob, blob.stat().st_size, {"ETag": f'"{segs[1]}"', "Accept-Ranges": "bytes"}, "/".join(segs[2:]))

    def _file(self, path: Path, size: int, headers: dict[str, str], name: str) -> None:
        ctype = "application/json" if name.endswith(".json") else "application/octet-stream"
        headers = {**headers, "Content-Type": ctype}
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng is not None:
            m = _RANGE_RE.fullmatch(rng)
            if m is not None and (m.group(1) or m.group(2)):  # multiple or malformed ranges: ignored, as RFC 9110 allows
                first, last = m.group(1), m.group(2)
                if first:
                    start = int(first)
                    end = min(int(last), size - 1) if last else size - 1
                else:  # suffix: the last N bytes
                    start, end = max(0, size - int(last)), size - 1
                if start >= size or (not first and int(last) == 0):
                    self._send(416, {"Content-Range": f"bytes */{size}", "X-Error-Message": "Range Not Satisfiable"})
                    return
                if start <= end:
                    status = 206
                    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
                else:
                    start, end = 0, size - 1
        length = max(0, end - start + 1)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD" or length == 0:
            return
        with open(path, "rb") as fh:
            fh.seek(start)
            left = length
            while left > 0:
                chunk = fh.read(min(_CHUNK, left))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)


# --------------------------------------------------------------------------- client configuration


def configure_huggingface_hub(monkeypatch: Any, *, endpoint: str, cache_dir: Path | str,
                              offline: bool = False) -> None:
    """Point the real huggingface_hub, in this process and its children, at `endpoint` and `cache_dir`.

    `monkeypatch` is pytest's (anything with setenv/delenv/setattr). Sets HF_ENDPOINT, HF_HUB_CACHE
    and HF_HUB_OFFLINE (TRANSFORMERS_OFFLINE removed: huggingface_hub reads it as HF_HUB_OFFLINE)
    for subprocesses, and the `huggingface_hub.constants` that hold them, read at import, for this
    process. The saved-token file is pointed into the cache folder (absent), so a developer's own
    token never reaches the stand-in; HF_TOKEN still works (it is read at call time).
    """
    from huggingface_hub import constants

    endpoint = endpoint.rstrip("/")
    cache_dir = str(cache_dir)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", cache_dir)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    token_path = os.path.join(cache_dir, ".no-saved-token", "token")
    monkeypatch.setenv("HF_TOKEN_PATH", token_path)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", token_path)
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", os.path.join(os.path.dirname(token_path), "stored_tokens"))


__all__ = ["HubStandIn", "RepoFile", "RepoState", "LFS_SUFFIXES", "configure_huggingface_hub"]
