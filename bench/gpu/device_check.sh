#!/usr/bin/env bash
# The GPU checks in one call on a lent GPU machine (the `device` tool): the `gpu` tests, gpu_loop with the
# hf engine (lmc calibrate, memory vs plan, TPOT vs roofline), then gpu_loop with DeepSpeed (AutoTP).
# The machine's image has torch, transformers and nvcc but none of lmc's other needs: they travel as
# wheels in .whl (docs/measurements.md, "GPU checks"). vLLM's GPU wheel is too large to travel.
#
#   here:   bash bench/gpu/fetch_wheels.sh   (builds .whl from this checkout's .venv)
#   device: run(command="bash bench/gpu/device_check.sh", carry=[".whl"], timeout_s=560)
# On a cold machine `lmc calibrate --device cuda` took 104-120+ s (2026-11-27): it gets 150 s, and the
# DeepSpeed loop reuses the profile the hf loop measured.
#
# Everything lands under $OUT: device.log (this script's output), ds_jit.log, results-*.json, logs.txt.
set -u
OUT=${OUT:-/tmp/lmc-device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
# The image sets TORCH_CUDA_ARCH_LIST with an arch-specific entry ("9.0a") that DeepSpeed 0.19.8's JIT
# builder cannot parse (ValueError: invalid literal for int() with base 10: '0a'): name plain 9.0.
echo "TORCH_CUDA_ARCH_LIST was: ${TORCH_CUDA_ARCH_LIST:-unset}"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${ARCH:-9.0} MAX_JOBS=${MAX_JOBS:-12}
LAYERS=${LAYERS:-8}
WORK=${WORK:-/tmp/lmc-gpu-loop}
start=$SECONDS
stamp() { echo "=== $((SECONDS - start)) s: $*"; }

stamp "wheels"
if [ "${WHEELS:-1}" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || { echo "wheels failed"; exit 1; }
fi
# lmc itself from this checkout, for every process the checks start
echo "$PWD" > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/lmc-checkout.pth"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers, deepspeed, lmc; print('python', sys.version.split()[0], '| torch', torch.__version__,
'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__)"
python3 -c "import vllm" 2>/dev/null && echo "vllm: installed" || echo "vllm: not installed"

# DeepSpeed's inference kernels are only built when asked (DS_JIT=1): kernel injection is off
# (engines.toml), so nothing below needs them; the build (~140 s) is how to try injection again.
jit=""
if [ "${DS_JIT:-0}" = 1 ]; then
    stamp "DeepSpeed's inference kernels: just-in-time build started in the background"
    ( timeout "${JIT_S:-330}" python3 -c "from deepspeed.ops.op_builder import InferenceBuilder; InferenceBuilder().load()" \
        > "$OUT/ds_jit.log" 2>&1; echo "jit exit $?" >> "$OUT/ds_jit.log" ) &
    jit=$!
fi

loop() {  # loop ENGINE SECONDS
    stamp "gpu_loop $1"
    timeout "$2" python3 bench/gpu/gpu_loop.py --work "$WORK" --engines "$1" --layers "$LAYERS" \
        --calibrate-timeout "${CALIBRATE_S:-150}"
    echo "gpu_loop $1: exit $?"
    cp "$WORK/results.json" "$OUT/results-$1.json" 2>/dev/null
    for log in "$WORK"/calibrate.log "$WORK"/runtime-"$1".log; do [ -f "$log" ] && { echo "--- $log"; tail -n 40 "$log"; } >> "$OUT/logs.txt"; done
}

# A step given 0 seconds is skipped (TESTS_S=0, HF_S=0, DS_S=0).
if [ "${TESTS_S:-150}" -gt 0 ]; then
    stamp "gpu tests"
    timeout "${TESTS_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/test_runtime_e2e.py \
        tests/test_engine_deepspeed.py tests/test_build_vllm.py tests/test_runtime_vllm_served.py}
    echo "gpu tests: exit $?"
fi
[ "${HF_S:-280}" -gt 0 ] && loop hf "${HF_S:-280}"
if [ -n "$jit" ]; then
    stamp "waiting for the kernel build"
    wait "$jit"
    tail -n 5 "$OUT/ds_jit.log"
fi
[ "${DS_S:-130}" -gt 0 ] && loop deepspeed "${DS_S:-130}"
stamp "done"
