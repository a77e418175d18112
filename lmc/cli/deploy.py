"""`lmc deploy SPEC --target sagemaker|kubernetes|kserve [-o DIR]`: plan, then write the deployment files.

No weights are needed (as for `lmc plan`): the files are sized from the plan and what `lmc build` would pack
for it, or, with --artifact, from the built artifact's manifest. They go to DIR/<target>/ (default DIR:
deploy), replacing what an earlier run wrote there.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from lmc.errors import UsageError

_OURS = (".json", ".yaml", ".md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lmc.emitters.deploy import TARGETS

    parser.add_argument("spec", metavar="SPEC", help="the deployment spec (TOML)")
    parser.add_argument("--target", required=True, choices=TARGETS, help="where to deploy")
    parser.add_argument("-o", "--output", metavar="DIR", default="deploy",
                        help="directory to write DIR/<target>/ into (default: deploy)")
    parser.add_argument("--name", default=None, help="resource name (default: [deploy] name, else the spec's file name)")
    parser.add_argument("--image", default=None, help="container image URI (default: [deploy] image)")
    parser.add_argument("--role", default=None, dest="role_arn",
                        help="SageMaker execution role ARN (default: [deploy] role_arn)")
    parser.add_argument("--accept-missed-goal", action="store_true",
                        help="write the files for a plan that fits but misses its goal (without it: exit 4)")
    parser.add_argument("--model-data", default=None,
                        help="the artifact's location: s3://.../model.tar.gz or an S3 prefix (default: [deploy] model_data)")
    parser.add_argument("--service-account", default=None,
                        help="Kubernetes service account the pods run as (default: [deploy] service_account, else the name)")
    parser.add_argument("--artifact", metavar="PATH", default=None,
                        help="the built artifact (model.tar.gz or a --format dir tree): size storage and timeouts from "
                             "what its manifest lists instead of predicting what `lmc build` packs")


def run(args: argparse.Namespace) -> int:
    from lmc.emitters.deploy import Account, read_built_artifact, render_deployment, resource_name
    from lmc.pipeline import plan_from_spec
    from lmc.schema import load_spec
    from lmc.schema.spec import DeploySpec
    from lmc.planner.sizing import copy_layout

    from lmc.planner.goals import refuse_missed_goal

    loaded = load_spec(args.spec)
    result = plan_from_spec(loaded)
    refuse_missed_goal(result.plan, args.accept_missed_goal, "deploy")
    given = loaded.spec.deploy
    flags = {key: value for key in ("name", "image", "role_arn", "model_data", "service_account")
             if (value := getattr(args, key)) is not None}
    if flags:  # flags are checked by the same rules as the spec's [deploy] keys
        try:
            given = DeploySpec.model_validate({**given.model_dump(exclude_none=True), **flags})
        except ValueError as exc:
            error = exc.errors()[0] if hasattr(exc, "errors") else {"loc": ("?",), "msg": str(exc)}
            raise UsageError(f"{_flag(str(error['loc'][0]))}: {error['msg']}") from None
    account = Account(name=given.name or resource_name(Path(args.spec).stem), image=given.image,
                      role_arn=given.role_arn, model_data=given.model_data, service_account=given.service_account)
    built = read_built_artifact(args.artifact) if args.artifact is not None else None
    files = render_deployment(args.target, result.plan, result.hardware, account, built)
    out = Path(args.output)
    _replace_directory(out / args.target, {path.split("/", 1)[1]: body for path, body in files.items()})
    plan = result.plan
    d = plan.deployment
    print(f"plan: {plan.model.id} on {d.instances} × {plan.target.instance}: {plan.engine} {plan.dtype}, "
          f"{copy_layout(plan)}, autoscaling {d.min_instances}-{d.max_instances}")
    for path in files:
        print(f"  wrote {out / path}")
    missing = account.placeholders(args.target)
    if missing:
        print("fill in (placeholders marked REPLACE_ME): " + ", ".join(
            f"{key} ([deploy] {key} or {_flag(key)})" for key in missing),
            file=sys.stderr)
    return 0


def _flag(key: str) -> str:
    """The flag that sets [deploy] `key` (role_arn: --role)."""
    return "--" + key.replace("_arn", "").replace("_", "-")


def _replace_directory(target: Path, files: dict[str, bytes]) -> None:
    """Write `files` into `target`, replacing an earlier run's files; a directory holding anything else is refused."""
    if target.exists():
        if not target.is_dir() or any(not p.is_file() or p.suffix not in _OURS for p in target.iterdir()):
            raise UsageError(f"{target} exists and holds files lmc deploy did not write; choose another -o DIR")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for name, body in files.items():
            (staging / name).write_bytes(body)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
