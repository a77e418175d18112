"""Measured figures in place of estimated ones: a profile written by `lmc calibrate` carries, per
engine, what that engine achieved on the machine (`HardwareFacts.measured`). The latency and memory
model keep their formulas; only the efficiency figures they read change.

- decode_bandwidth = measured batch-1 decode bandwidth for the weight dtype / the profile's peak
- prefill_compute  = measured prefill TFLOPS for the compute dtype / the profile's peak TFLOPS
- decode_compute   = measured decode TFLOPS (what each extra batch row costs) / the peak
- step_overhead_ms, layer_overhead_ms, prefill_overhead_ms, runtime_overhead_bytes: as measured
- allreduce_efficiency = 1, allreduce_overhead_us = 0 and load_efficiency = 1: the profile's
  interconnect and load figures were measured as achieved (all-reduces through torch.distributed
  between local processes, a cold file read), not taken from a datasheet.

A dtype calibrate did not measure keeps the engine's estimated share for it.
"""

from __future__ import annotations

from lmc.planner.facts import EngineEfficiency, HardwareFacts


def measured_efficiency(efficiency: EngineEfficiency, hardware: HardwareFacts, engine_name: str,
                        dtype: str | None = None, compute_dtype: str | None = None) -> EngineEfficiency:
    """`efficiency` with what the profile measured for `engine_name` (unchanged when it measured nothing).

    `dtype` (the weights') and `compute_dtype` pick the per-dtype figures; without them only the
    dtype-free ones apply (what the memory model reads)."""
    measured = hardware.measured.get(engine_name)
    if measured is None:
        return efficiency
    update: dict[str, float | int] = {
        "step_overhead_ms": measured.step_overhead_ms,
        "layer_overhead_ms": measured.layer_overhead_ms,
        "prefill_overhead_ms": measured.prefill_overhead_ms,
        "allreduce_efficiency": 1.0,
        "allreduce_overhead_us": 0.0,
        "load_efficiency": 1.0,
    }
    if measured.runtime_overhead_bytes is not None:
        update["runtime_overhead_bytes"] = measured.runtime_overhead_bytes
    if dtype in measured.decode_bandwidth_bytes_per_s:
        update["decode_bandwidth"] = measured.decode_bandwidth_bytes_per_s[dtype] / hardware.memory_bandwidth_bytes_per_s
    if compute_dtype in hardware.tflops:
        if compute_dtype in measured.prefill_tflops:
            update["prefill_compute"] = measured.prefill_tflops[compute_dtype] / hardware.tflops[compute_dtype]
        if compute_dtype in measured.decode_tflops:
            update["decode_compute"] = measured.decode_tflops[compute_dtype] / hardware.tflops[compute_dtype]
    update["source"] = f"{measured.source} (measured profile); otherwise {efficiency.source}"
    return efficiency.model_copy(update=update)
