"""`lmc build`: spec -> plan -> validated checkpoint -> staged tree -> deterministic artifact.

The order is the contract: everything that can fail cheaply (the plan, the output path, the Neuron
SDK, the checkpoint's headers and shapes) is checked before any weight is read. The tree is staged
in a temporary directory next to `out` (same filesystem, so the final rename is atomic) and the
staging directory is removed whatever happens: a failed build leaves nothing behind.

Artifact layout (docs/artifact.md): serving.properties, model.py, requirements.txt, lmc.json, the
checkpoint's config.json / generation_config.json / tokenizer files, then
  hf, deepspeed:  shards/tp{N}/rank{r}.safetensors, already in the planned dtype;
  neuronx:        model.safetensors (cast, whole) and neuron/ (see lmc.emitters.neuron);
  vllm:           no model.py; vLLM's model-rank-{r}-part-{p}.safetensors (load_format=sharded_state)
                  when the build machine can run vLLM for the plan, else model.safetensors (cast, whole)
                  (see lmc.emitters.vllm_weights); adapters/<name>/ and draft/ when the plan serves
                  LoRA adapters or a speculative proposer (lmc.emitters.served).
With model.uri set, no weights and no checkpoint files are packed: the container loads them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Literal

from lmc import __version__
from lmc.emitters import neuron
from lmc.emitters.render import render_neuron_readme, render_text_files
from lmc.emitters.served import stage_served
from lmc.errors import ArtifactError, InternalError, SpecValueError
from lmc.manifest import MANIFEST_NAME, build_manifest, manifest_bytes, sha256_file, verify_artifact
from lmc.planner.plan import Plan
from lmc.schema import LoadedSpec

Format = Literal["tar.gz", "dir"]
FORMATS: tuple[str, ...] = ("tar.gz", "dir")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class BuildResult:
    """What `build_artifact` wrote."""

    out: Path
    format: str
    plan: Plan
    files: dict[str, int]  # relative path -> size in bytes, sorted; lmc.json included
    archive_sha256: str | None  # of the .tar.gz; None for --format dir
    archive_bytes: int  # the archive's size, or the tree's total for dir
    notes: tuple[str, ...] = ()  # what the build did differently from what the plan prefers, and why

    @property
    def total_file_bytes(self) -> int:
        return sum(self.files.values())


def build_artifact(loaded: LoadedSpec, out: Path, *, fmt: str = "tar.gz", allow_pickle: bool = False,
                   progress: Progress | None = None, expected_plan: dict | None = None,
                   accept_missed_goal: bool = False) -> BuildResult:
    """Plan `loaded`, then write the artifact at `out`. Raises LmcError (one line); leaves nothing on failure.

    `expected_plan`: the plan JSON that was reviewed (`lmc plan --json`); the build stops when planning
    again gives another plan, naming both commits when the model's revision moved. A plan that misses its
    goal stops the build (GoalMissedError, exit 4) unless `accept_missed_goal`."""
    from lmc.pipeline import plan_from_spec
    from lmc.planner.goals import refuse_missed_goal

    if fmt not in FORMATS:
        raise InternalError(f"unknown artifact format {fmt!r}")
    say = progress or (lambda message: None)
    out = Path(out)
    result = plan_from_spec(loaded)
    plan, spec = result.plan, loaded.spec
    if expected_plan is not None:
        check_expected_plan(plan, expected_plan)
    refuse_missed_goal(plan, accept_missed_goal, "build")
    profile = loaded.source.base_dir / spec.target.profile if spec.target.profile else None
    _check_output(out, fmt, inputs=[loaded.source.path, profile], checkpoint=result.checkpoint)

    check_pipeline_plan(plan)
    weights_remote = spec.model.uri is not None
    precompile = neuron.graphs_precompiled(plan, weights_remote)
    # The SDK check comes before any weight is read: a build that cannot finish stops at once.
    sdk = neuron.load_neuron_sdk() if precompile else None

    info = None
    checkpoint = result.checkpoint
    if not weights_remote:
        if checkpoint is None and plan.model.revision is not None:  # planned from the Hub: fetch that commit
            from lmc.hub import download_checkpoint

            say(f"downloading {plan.model.id} at {plan.model.revision} (the files the plan needs)")
            try:
                checkpoint = download_checkpoint(plan.model.id, plan.model.revision, allow_pickle=allow_pickle)
            except SpecValueError as exc:
                raise loaded.source.error(exc.key_path, exc.detail, exc.value) from None
        if checkpoint is None:
            raise loaded.source.error(
                "model", "nothing to pack: give `path` (a local checkpoint to pack) or `uri` (remote weights the "
                         "container loads), or let lmc download the model from the Hub (HF_ENDPOINT reachable)")
        from lmc.emitters.checkpoint import validate_checkpoint

        say(f"validating checkpoint {checkpoint}")
        info = validate_checkpoint(checkpoint, result.model, allow_pickle=allow_pickle,
                                   quantized=plan.model.checkpoint_quantization is not None)
        result = replace(result, checkpoint=checkpoint)

    staging = _make_staging(out)
    vllm_format = vllm_note = None  # what a vLLM build packed (sharded_state or checkpoint), and why
    try:
        try:
            if info is not None:
                _copy_checkpoint_files(info, result.checkpoint, staging)
                if plan.engine == "neuronx":
                    _stage_neuron_weights(info, plan, result.model, staging, progress)
                elif plan.engine == "vllm":
                    vllm_format, vllm_note = _stage_vllm_weights(info, plan, result, staging, say, progress)
                else:
                    from lmc.emitters.partition import partition_checkpoint

                    say(f"partitioning weights for tensor parallel degree {plan.tensor_parallel_degree} ({plan.dtype})")
                    partition_checkpoint(info, family=plan.model.family, dtype=plan.dtype,
                                         tp=plan.tensor_parallel_degree, head_dim=result.model.head_dim,
                                         kv_heads=result.model.kv_heads, out_dir=staging, progress=progress)
            if plan.engine == "neuronx":
                if precompile:
                    say(f"compiling Neuron graphs ({neuron.sampling_class(plan.model.family)})")
                    neuron.run_neuron_compile(neuron.neuron_compile_plan(plan, staging), sdk)
                else:
                    neuron.write_compile_record(staging, neuron.deferred_compile_record(plan, weights_remote))
                _write(staging / neuron.README, render_neuron_readme(plan, spec))

            try:  # adapters/<name>/ and draft/ (lmc.served_artifact)
                stage_served(loaded, plan, staging, say)
            except SpecValueError as exc:
                raise loaded.source.error(exc.key_path, exc.detail, exc.value) from None
            for name, data in render_text_files(plan, spec, vllm_format).items():
                _write(staging / name, data)
            files = _write_manifest(staging, loaded, plan)
            try:  # the runtime's own check, sizes only: what it would refuse is lmc's bug, not the user's
                verify_artifact(staging, check_hashes=False)
            except ArtifactError as exc:
                raise InternalError(f"the build staged an artifact that `lmc runtime` would refuse: {exc}") from None

            from lmc.emitters.archive import write_artifact

            say(f"writing {out}")
            written = Path(write_artifact(staging, out, fmt=fmt, move=True) if fmt == "dir" else write_artifact(staging, out, fmt=fmt))
        except OSError as exc:  # disk full, file too large, an I/O error: one line, exit 1, nothing left behind
            raise ArtifactError(f"{out}: cannot build the artifact: {exc.filename or out}: "
                                f"{exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    notes = (vllm_note,) if vllm_note else ()
    if fmt == "tar.gz":
        return BuildResult(out=written, format=fmt, plan=plan, files=files,
                           archive_sha256=sha256_file(written), archive_bytes=written.stat().st_size, notes=notes)
    return BuildResult(out=written, format=fmt, plan=plan, files=files, archive_sha256=None,
                       archive_bytes=sum(files.values()), notes=notes)


def check_expected_plan(plan: Plan, expected: dict) -> None:
    """The plan being built is the reviewed one (same digest), or a one-line error saying what moved."""
    from lmc.errors import LmcError
    from lmc.manifest import digest_json

    # The file itself first: its plan_sha256 is the digest of the rest of it as `lmc plan --json` wrote it, so a
    # plan edited by hand (a TP degree, a figure) keeps a digest that no longer describes it; the build would
    # make the plan the digest names, not the one the reviewers read.
    stated = expected.get("plan_sha256")
    if digest_json({**expected, "plan_sha256": ""}) != stated:
        raise LmcError(f"the reviewed plan was edited after `lmc plan --json` wrote it (its content does not match "
                       f"its plan_sha256 {str(stated)[:12]}): review a plan lmc wrote, not an edited one")
    if stated == plan.plan_sha256:
        return
    was = (expected.get("model") or {}).get("revision")
    if was != plan.model.revision:
        raise LmcError(f"model.revision: the reviewed plan read {plan.model.id} at {was}; the Hub now serves "
                       f"{plan.model.revision} for this spec: plan again and review, or pin model.revision = \"{was}\"")
    raise LmcError(f"the plan differs from the reviewed one (plan_sha256 {str(expected.get('plan_sha256'))[:12]} "
                   f"reviewed, {plan.plan_sha256[:12]} now): plan again and review it")


def _check_output(out: Path, fmt: str, inputs: list[Path | None] = (), checkpoint: Path | None = None) -> None:
    """Fail before any work when `out` cannot be written, or would replace an input (the spec, its
    profile, anything in the checkpoint) or something that is not a regular file (a device, a fifo)."""
    parent = out.parent if str(out.parent) else Path(".")
    where = out.resolve()
    for path in filter(None, inputs):
        if path.resolve() == where:
            raise ArtifactError(f"{out}: is an input of this build ({path}); give another output path")
    if checkpoint is not None and where.is_relative_to(checkpoint.resolve()):
        raise ArtifactError(f"{out}: is inside the checkpoint {checkpoint}; give an output path outside it")
    if out.exists() and not (out.is_file() or out.is_dir()):
        raise ArtifactError(f"{out}: exists and is not a regular file; refusing to replace it")
    if not parent.is_dir():
        raise ArtifactError(f"{out}: cannot write the artifact: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"{out}: cannot write the artifact: {parent} is not writable")
    if fmt == "tar.gz" and out.is_dir():
        raise ArtifactError(f"{out}: is a directory; give a file name for the .tar.gz (or --format dir)")
    if fmt == "dir" and out.exists() and not out.is_dir():
        raise ArtifactError(f"{out}: exists and is not a directory; --format dir writes a directory")
    if fmt == "dir" and out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise ArtifactError(f"{out}: exists, is not empty and is not an lmc artifact; refusing to overwrite it")


def _make_staging(out: Path) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent if str(out.parent) else "."))
    except OSError as exc:
        raise ArtifactError(f"{out}: cannot stage the artifact next to it: {exc.strerror or exc}") from None


def _copy_checkpoint_files(info: Any, checkpoint: Path, staging: Path) -> None:
    """config.json and the validator's extra files (generation config, tokenizer), byte for byte."""
    for name in sorted({"config.json", *info.extra_files}):
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkpoint / name, target)


def check_pipeline_plan(plan: Plan) -> None:
    """lmc runs plans across instances on vLLM's multi-node engine only (lmc.runtime.vllm_nodes,
    lmc.runtime.vllm_ray): any other engine with a pipeline degree > 1 stops the build with one line."""
    stages = plan.deployment.pipeline_parallel_degree
    if stages > 1 and plan.engine != "vllm":
        raise ArtifactError(f"pipeline parallel degree {stages}: lmc runs plans across instances on vLLM's "
                            f"multi-node engine only, not {plan.engine} (lmc's own hf pipeline was removed)")


def _stage_neuron_weights(info: Any, plan: Plan, model: Any, staging: Path, progress: Progress | None) -> None:
    """The whole checkpoint cast to the planned dtype, as model.safetensors next to config.json.

    transformers-neuronx reads a standard HF directory and shards across NeuronCores itself, so the
    weights stay whole (TP 1 in the partitioner's terms). int8 is quantized by the SDK from f16.
    """
    _stage_whole_weights(info, plan, model, staging, progress, "fp16" if plan.dtype == "int8" else plan.dtype)


def _stage_vllm_weights(info: Any, plan: Plan, result: Any, staging: Path, say: Progress,
                        progress: Progress | None) -> tuple[str, str | None]:
    """vLLM's sharded_state files when this machine can run vLLM for the plan, else the checkpoint in the
    planned dtype (16-bit for fp8: vLLM quantizes as it loads). Returns which (lmc.emitters.vllm_weights),
    and for a GPU plan that could not get sharded_state, the note saying so."""
    from lmc.emitters import vllm_weights

    if plan.model.checkpoint_quantization is not None:
        # A quantized checkpoint goes in as it is: vLLM reads its quantization_config and loads the
        # quantized tensors with their scales (lmc neither casts nor re-partitions them).
        say(f"packing the {plan.model.checkpoint_quantization} checkpoint as it is")
        for file in info.files:
            shutil.copyfile(file, staging / file.name)
        index = info.path / "model.safetensors.index.json"
        if index.is_file():
            shutil.copyfile(index, staging / index.name)
        return "checkpoint", None
    why_not = vllm_weights.sharded_state_unavailable(plan)
    if why_not is None:
        say(f"writing vLLM sharded_state for tensor parallel degree {plan.tensor_parallel_degree} (vLLM loads the model)")
        vllm_weights.write_sharded_state(plan, result.checkpoint, staging)
        return "sharded_state", None
    dtype = vllm_weights.packed_dtype(plan)
    note = (f"packed the checkpoint in {dtype} as model.safetensors, not vLLM sharded_state: {why_not}; "
            "vLLM partitions it as it loads (build on a machine with the GPUs for pre-partitioned weights)")
    say(note)
    _stage_whole_weights(info, plan, result.model, staging, progress, dtype)
    return "checkpoint", (note if plan.target.accelerator != "cpu" else None)


def _stage_whole_weights(info: Any, plan: Plan, model: Any, staging: Path, progress: Progress | None,
                         dtype: str) -> None:
    """The whole checkpoint cast to `dtype`, as model.safetensors next to config.json."""
    from lmc.emitters.partition import partition_checkpoint

    scratch = staging / ".whole-weights"
    partition_checkpoint(info, family=plan.model.family, dtype=dtype, tp=1, head_dim=model.head_dim,
                         kv_heads=model.kv_heads, out_dir=scratch, progress=progress)
    whole = scratch / "shards" / "tp1" / "rank0.safetensors"
    if not whole.is_file():
        raise InternalError(f"the partitioner wrote no {whole.relative_to(scratch)}")
    os.replace(whole, staging / neuron.WEIGHTS_FILE)
    shutil.rmtree(scratch)


def _write_manifest(staging: Path, loaded: LoadedSpec, plan: Plan) -> dict[str, int]:
    """Write lmc.json over every other file; returns {path: size} for all files, lmc.json included."""
    entries: dict[str, tuple[int, str]] = {}
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        rel = path.relative_to(staging).as_posix()
        if rel == MANIFEST_NAME:
            continue
        entries[rel] = (path.stat().st_size, sha256_file(path))
    manifest = build_manifest(__version__, loaded.spec.model_dump(mode="json"), plan.to_dict(), entries)
    data = manifest_bytes(manifest)
    _write(staging / MANIFEST_NAME, data)
    sizes = {rel: size for rel, (size, _) in entries.items()}
    sizes[MANIFEST_NAME] = len(data)
    return dict(sorted(sizes.items()))


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
