"""`lmc calibrate [--out PROFILE.toml]`: measure this machine and write a hardware profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", "-o", type=Path, help="write the profile here (default: print it)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="what to measure: this CPU (default) or the CUDA GPUs")
    parser.add_argument("--dtypes", help="comma-separated dtypes to measure (default: fp32,bf16 on CPU, fp16,bf16 on GPU)")
    parser.add_argument("--base", metavar="INSTANCE_OR_ACCELERATOR",
                        help="a catalog instance whose devices these are (its name, price, device count), or a "
                             "catalog accelerator (with --device cuda: as many as torch sees); default: the local target")
    parser.add_argument("--scratch", type=Path, help="directory for the storage read test (default: the temp directory)")


def _base_facts(name: str, device: str):
    """A catalog instance, else a catalog accelerator times the devices torch sees (one on CPU)."""
    from lmc.errors import SpecValueError, UsageError
    from lmc.planner import catalog

    try:
        return catalog.hardware_facts(name)
    except SpecValueError as instance_error:
        if name.strip().lower() not in catalog.list_accelerators() and device != "cuda":
            raise UsageError(f"--base {name}: {instance_error.detail}") from None
    try:
        devices = 1
        if device == "cuda":
            import torch

            devices = max(torch.cuda.device_count(), 1)
        return catalog.accelerator_facts(name, devices)
    except SpecValueError as exc:
        raise UsageError(f"--base {name}: neither a catalog instance nor a catalog accelerator ({exc.detail})") from None


def run(args: argparse.Namespace) -> int:
    from lmc.errors import UsageError
    from lmc.measure.calibrate import calibrate
    from lmc.measure.profile import render_profile
    from lmc.planner import catalog

    dtypes = None
    if args.dtypes:
        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        allowed = ("fp32", "bf16") if args.device == "cpu" else ("fp32", "fp16", "bf16")
        bad = [d for d in dtypes if d not in allowed]
        if bad or not dtypes:
            raise UsageError(f"--dtypes {args.dtypes!r}: choose from {', '.join(allowed)} on {args.device}")
    base = _base_facts(args.base, args.device) if args.base else None
    if args.scratch is not None and not args.scratch.is_dir():
        raise UsageError(f"--scratch {args.scratch}: not a directory")
    if args.out is not None and not args.out.parent.resolve().is_dir():
        raise UsageError(f"--out {args.out}: its directory does not exist")
    text = render_profile(calibrate(args.device, dtypes, args.scratch, accelerator=base.accelerator if base else None),
                          base)
    # The profile must load as a spec would load it: check before writing.
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as tmp:
        tmp.write(text)
    try:
        catalog.profile_facts(Path(tmp.name))
    finally:
        Path(tmp.name).unlink()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
