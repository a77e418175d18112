"""A `Calibration` as a hardware profile: the catalog-entry TOML that `[target] profile` names and
`lmc.planner.catalog.profile_facts` loads. Pure: figures in, text out; every figure carries a comment
saying what was measured, and the header says when and on what."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from lmc.planner.facts import HardwareFacts

if TYPE_CHECKING:
    from lmc.measure.calibrate import Calibration


def _number(value: float) -> str:
    """A float TOML reads back as the same float, in 4 significant digits (measurements are not finer)."""
    return repr(float(f"{value:.4g}"))


def _table(values: dict[str, float]) -> str:
    return "{ " + ", ".join(f"{key} = {_number(value)}" for key, value in values.items()) + " }"


def _peaks(calibration: Calibration) -> tuple[float, dict[str, float]]:
    """Peak bandwidth and TFLOPS at least the achieved ones (the planner reads achieved / peak as a share ≤ 1)."""
    bandwidth = max([calibration.stream_bandwidth, *calibration.decode_bandwidth.values()])
    tflops = {dtype: max(calibration.matmul_tflops.get(dtype, 0.0), calibration.prefill_tflops.get(dtype, 0.0),
                         calibration.decode_tflops.get(dtype, 0.0))
              for dtype in calibration.matmul_tflops}
    # _number rounds to 4 digits: a peak must not round below the achieved figure it bounds.
    return float(_number(bandwidth * 1.0005)), {dtype: float(_number(value * 1.0005)) for dtype, value in tflops.items()}


def render_profile(calibration: Calibration, base: HardwareFacts | None = None) -> str:
    """The profile TOML. `base` (a catalog instance's facts) supplies the name, price, device count and
    interconnect name of an instance whose devices were measured (a GPU host); without it the
    profile describes this machine as the `local` target."""
    c = calibration
    bandwidth, tflops = _peaks(c)
    dtypes = list(c.matmul_tflops)
    if base is not None:
        tflops = {**{d: v for d, v in base.tflops.items() if d in base.dtypes}, **tflops}
        dtypes = list(dict.fromkeys([*base.dtypes, *dtypes]))
    name = base.name if base else "local"
    accelerator = base.accelerator if base else c.accelerator
    kind = base.kind if base else ("cpu" if c.device == "cpu" else "gpu")
    devices = base.devices if base else c.devices
    link_name = base.interconnect.name if base else f"shared memory ({c.allreduce_backend})"
    link_base, link_algorithm = 0.0, "ring"
    if c.allreduce_latency_us is not None and c.allreduce_bandwidth is not None:
        # A ring all-reduce over 2 ranks takes 2 steps: the 4-byte one's time is 2 step latencies.
        link_latency, link_bandwidth = c.allreduce_latency_us / 2, c.allreduce_bandwidth
        link_comment = (f"# all-reduce between 2 local processes over {c.allreduce_backend}: a 4-byte one "
                        f"({c.allreduce_latency_us:.0f} µs, median of 200) is 2 ring steps of latency_us; a 16 MiB one "
                        "gives the bandwidth")
    elif base is not None:
        link_latency, link_bandwidth = base.interconnect.latency_us, base.interconnect.bandwidth_bytes_per_s
        link_base, link_algorithm = base.interconnect.allreduce_base_us, base.interconnect.algorithm
        link_comment = f"# not measured (one device): {base.name}'s catalog figures"
    else:
        link_latency, link_bandwidth = 50.0, 5e9
        link_comment = "# not measured: lmc's defaults for the local target"
    engine = c.engine
    source = (f"lmc calibrate, {c.measured_at}, {c.host}: stream copy, matmuls, lmc's decode loop on random "
              f"Llama models, {c.allreduce_backend} all-reduce, a cold file read")
    lines = [
        f"# A hardware profile measured by `lmc calibrate` on {c.measured_at}",
        f"# on {c.host}.",
        "# Name it in a spec as `[target] profile = \"...\"` (catalog-entry format: lmc/planner/catalog.py).",
        "# Figures on a shared machine move with its load: calibrate again when it is quiet, or when it changes.",
        *[f"# note: {note}" for note in c.notes],
        f"name = {json.dumps(name)}",
        f"accelerator = {json.dumps(accelerator)}",
        f"kind = {json.dumps(kind)}",
        f"devices = {devices}",
        f"device_memory_bytes = {base.device_memory_bytes if base else c.device_memory_bytes}"
        + ("  # the catalog's" if base else ("  # RAM, /proc/meminfo" if c.device == "cpu" else "  # torch.cuda")),
        f"host_memory_bytes = {(base.host_memory_bytes or c.host_memory_bytes) if base else c.host_memory_bytes}",
        f"memory_bandwidth_bytes_per_s = {_number(bandwidth)}  # 256 MiB tensor copy, read + write, best of several"
        " (or the decode bandwidth below, where higher)",
        f"tflops = {_table(tflops)}  # square matmuls, best of several (or the prefill figure below, where higher)",
        f"dtypes = {json.dumps(dtypes)}",
        link_comment,
        f"interconnect = {{ name = {json.dumps(link_name)}, bandwidth_bytes_per_s = {_number(link_bandwidth)}, "
        f"latency_us = {_number(link_latency)}, allreduce_base_us = {_number(link_base)}, "
        f"algorithm = {json.dumps(link_algorithm)} }}",
        f"load_bandwidth_bytes_per_s = {_number(c.load_bandwidth)}  # a 256 MiB file read back after evicting it from the page cache",
    ]
    if base is not None and base.price_per_hour is not None:
        lines.append(f"price_per_hour = {_number(base.price_per_hour)}  # the catalog's")
    lines += [
        f"source = {json.dumps(source)}",
        "",
        f"# What the `{engine}` engine achieved here, through lmc's decode loop (lmc/runtime/engines/generate.py).",
        "# The latency model reads these instead of engines.toml's estimates (lmc/planner/measured.py).",
        f"[measured.{engine}]",
        "# A ~512 MB random Llama per dtype, served by `lmc runtime` and driven as `lmc bench` drives one: the",
        "# rates at which lmc's latency model reproduces its batch-1 TPOT (weight bandwidth), its 128-token TTFT",
        "# and its batch-8 TPOT (what each extra row's skinny GEMMs cost)",
        f"decode_bandwidth_bytes_per_s = {_table(c.decode_bandwidth)}",
        f"prefill_tflops = {_table(c.prefill_tflops)}",
        f"decode_tflops = {_table(c.decode_tflops)}",
        "# 2- and 12-layer tiny models served at batch 1: per token = step + layers · per layer (loop, pipe, HTTP)",
        f"step_overhead_ms = {_number(c.step_overhead_ms)}",
        f"layer_overhead_ms = {_number(c.layer_overhead_ms)}",
        "# the served 2-layer model: a 2-token request's end-to-end less two tokens (HTTP, tokenizing, queue)",
        f"prefill_overhead_ms = {_number(c.prefill_overhead_ms)}",
    ]
    if c.runtime_overhead_bytes is not None:
        what = "the served 2-layer model's worker: peak RSS less its weights" if c.device == "cpu" \
            else "the served 2-layer model's worker: device memory (nvidia-smi) less its weights"
        lines += [f"# {what}", f"runtime_overhead_bytes = {c.runtime_overhead_bytes}"]
    lines.append(f"source = {json.dumps(f'lmc calibrate, {c.measured_at}')}")
    return "\n".join(lines) + "\n"
