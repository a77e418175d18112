#!/usr/bin/env bash
# The wheels bench/gpu/device_check.sh installs on a lent GPU machine, into .whl (git-ignored), here.
# That machine reaches no registry and its image (Python 3.12, torch, transformers, huggingface_hub, numpy,
# anyio, httpx, prometheus-client, h11 ...) lacks the rest of what lmc's runtime, bench and `gpu` tests need.
# Each wheel is the version this checkout's .venv holds, so the GPU runs what the tests here ran.
#
#   bash bench/gpu/fetch_wheels.sh        # then: run(command="bash bench/gpu/device_check.sh", carry=[".whl"])
#
# openai 3.x talks through httpx2 (with httpcore2, truststore and idna >= 3.18): without them the loop's
# `openai` client check fails (seen 2026-11-28). deepspeed ships as an sdist: its wheel is built here with
# DS_BUILD_OPS=0 (pure Python; the ops are built just in time there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
NAMES="pydantic pydantic-core annotated-types typing-inspection starlette uvicorn openai jiter sniffio
hjson syrupy httpx2 httpcore2 truststore idna"
ds=$("$PY" -c "import importlib.metadata as m; print(m.version('deepspeed'))")
mkdir -p .whl
# .whl is this script's: two versions of one package stop the install there, so only this run's wheels stay
# (the deepspeed wheel of the same version is kept: it takes a minute to build)
find .whl -maxdepth 1 -type f -name '*.whl' ! -name "deepspeed-$ds-*" -delete
pins=()
for name in $NAMES; do
    pins+=("$name==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls .whl/deepspeed-"$ds"-*.whl >/dev/null 2>&1 \
    || DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$ds" -w .whl
ls .whl
du -sh .whl
