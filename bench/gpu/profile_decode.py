"""Where a decode step of the hf engine's model goes on a GPU: wall time against the device's busy time.

    python bench/gpu/profile_decode.py [--layers 8] [--steps 32] [--device cuda]

A random Llama of the 7B width and a 384-token vocabulary (gpu_loop's model, `--layers` layers) in fp16, a 128-token prompt, then
greedy decode steps through the model's forward with its KV cache, batch 1. Per step: wall milliseconds
(synchronized), the kernels' summed device time and the count of kernel launches (torch.profiler). Wall
far above device time means the step waits on the host (Python and launches), not on memory bandwidth.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from gpu_loop import LLAMA_7B  # the loop's model (this directory is on sys.path when run as a script)


def main() -> int:
    parser = argparse.ArgumentParser(prog="profile_decode.py", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_decode: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU host")
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    config = LlamaConfig(**{**LLAMA_7B, "num_hidden_layers": args.layers}, vocab_size=384)  # the tiny tokenizer's
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    prompt = torch.randint(0, config.vocab_size, (1, 128), device=args.device)

    def decode(steps: int) -> list[float]:
        with torch.inference_mode():
            out = model(prompt, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(steps):
                sync()
                began = time.perf_counter()
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                sync()
                times.append((time.perf_counter() - began) * 1e3)
        return times

    decode(4)  # warm-up
    wall = decode(args.steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        decode(args.steps)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.device_time for e in kernels) / 1e3  # microseconds → ms
    # the profiled run also holds the prompt's prefill: count per decode step over steps + 1 forwards
    forwards = args.steps + 1
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    median = sorted(wall)[len(wall) // 2]
    print(f"{name}, {args.layers} layers, {weight_bytes / 2**30:.2f} GiB of weights, batch 1")
    print(f"wall per decode step: median {median:.2f} ms, min {min(wall):.2f} ms over {args.steps} steps")
    print(f"kernels per forward: {len(kernels) / forwards:.0f} launches, {device_ms / forwards:.2f} ms of device time")
    print(f"host-bound share of a step: {max(0.0, 1 - (device_ms / forwards) / median):.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
