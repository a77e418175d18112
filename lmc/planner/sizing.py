"""Deployment sizing: storage, timeouts, shared memory and the scaling target, from a plan. Pure.

Every figure carries the sentence that says where it came from; `lmc deploy` writes those into the
README beside the files. The plan already holds what the planner predicted (load time, requests
per second, instances); this module adds what the deployment files need on top of it:

- the artifact size: each rank's shard (memory_per_device.weights) × TP × pipeline stages, which is
  what `lmc build` packs (the shards of one model copy; embeddings replicated per rank);
- the download time: the artifact over min(the instance's network, the transfer rate below);
- timeouts: the prediction with margin (×2 and at least +2 minutes), in whole minutes, never above
  what the platform allows (SageMaker: 3600 s) — past that the deployment cannot work and is refused;
- the storage: the artifact (×2 for a .tar.gz, which is downloaded and then extracted) + 10 %,
  on the instance's NVMe where it has one (SageMaker takes no EBS volume there) or an EBS volume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmc.errors import NoFeasiblePlanError
from lmc.planner.facts import HardwareFacts
from lmc.layouts import instances_spanned, parallel_layout
from lmc.planner.plan import Plan

GB = 10**9
GIB = 2**30
# Transfer rates lmc assumes (estimates, not measurements): an uncompressed S3 prefix is fetched in
# parallel; a model.tar.gz is gunzipped in one stream.
S3_PREFIX_BYTES_PER_S = 1.0e9
TAR_GZ_BYTES_PER_S = 0.2e9
TIMEOUT_FACTOR = 2.0
TIMEOUT_FLOOR_S = 120  # margin added at least, for container start and the model server's own start-up
PLATFORM_MAX_TIMEOUT_S = 3600  # SageMaker's limit for both timeouts
MIN_TIMEOUT_S = 60  # SageMaker's floor
STORAGE_HEADROOM = 1.10
MAX_EBS_VOLUME_GB = 512  # SageMaker ProductionVariant.VolumeSizeInGB
SHM_PER_DEVICE_BYTES = 2 * GIB  # NCCL / gloo shared-memory buffers per rank (with room for the host side)
SCALING_UTILIZATION = 0.7  # scale out when the instances carry 70 % of what the plan says they can


@dataclass(frozen=True)
class Figure:
    value: int | float
    reason: str


@dataclass(frozen=True)
class Sizing:
    """What the deployment files are sized with, each with its origin."""

    artifact_bytes: Figure
    download_seconds: Figure
    download_timeout_s: Figure
    load_seconds: Figure
    startup_timeout_s: Figure
    storage_bytes: Figure  # what each instance must hold
    ebs_volume_gb: Figure | None  # None where the instance has NVMe storage (SageMaker takes no volume)
    shm_bytes: Figure
    devices_per_instance: Figure
    invocations_per_instance_per_minute: Figure  # target-tracking target value


def data_parallel_size(plan: Plan) -> int:
    """vLLM's data-parallel attention groups per model copy (1 without)."""
    return plan.vllm.data_parallel_size if plan.vllm is not None else 1


def instances_per_copy_of(plan: Plan) -> int:
    """Instances one model copy runs on: its pipeline stages, each spanning the instances its TP × DP ranks
    fill (lmc.layouts.instances_spanned; the runtime counts the same from the artifact's plan dict)."""
    ranks = plan.tensor_parallel_degree * data_parallel_size(plan)
    return plan.deployment.pipeline_parallel_degree * instances_spanned(ranks, plan.target.devices,
                                                                        plan.target.accelerator == "cpu")


def copy_layout(plan: Plan) -> str:
    """One copy's parallel layout in words: "TP 8 × PP 2", "DP 16 × TP 1"."""
    return parallel_layout(plan.tensor_parallel_degree, data_parallel_size(plan),
                           plan.deployment.pipeline_parallel_degree)


def replicas_per_instance(plan: Plan) -> int:
    """Model copies (or, across instances, parts of copies) one instance serves."""
    groups = max(plan.deployment.instances // instances_per_copy_of(plan), 1)
    return math.ceil(plan.replicas / groups)


def timeout_for(seconds: float, what: str, limit: int | None = PLATFORM_MAX_TIMEOUT_S) -> Figure:
    """A timeout above `seconds`: ×2, at least +2 minutes, rounded up to whole minutes."""
    raw = max(seconds * TIMEOUT_FACTOR, seconds + TIMEOUT_FLOOR_S, MIN_TIMEOUT_S)
    value = int(math.ceil(raw / 60) * 60)
    if limit is not None and value > limit:
        raise NoFeasiblePlanError(
            f"the {what} timeout would be {value} s (predicted {seconds:.0f} s × {TIMEOUT_FACTOR:g}), above the "
            f"platform's {limit} s", ["use a larger instance (faster load) or a Kubernetes target, which has no "
                                      "such limit"])
    return Figure(value, f"predicted {seconds:.0f} s × {TIMEOUT_FACTOR:g} (at least +{TIMEOUT_FLOOR_S} s), "
                         "rounded up to whole minutes")


def startup_timeout(load: float, server_timeout_s: int, limit: int | None) -> Figure:
    """Above the predicted load with margin, and above the model server's own loading timeout."""
    margin = timeout_for(load, "container start-up health check", None)
    raw = max(int(margin.value), server_timeout_s + TIMEOUT_FLOOR_S)
    value = int(math.ceil(raw / 60) * 60)
    if limit is not None and value > limit:
        raise NoFeasiblePlanError(
            f"the container start-up health check timeout would be {value} s (predicted load {load:.0f} s), above "
            f"the platform's {limit} s", ["use a larger instance (faster load) or a Kubernetes target, which has no "
                                          "such limit"])
    return Figure(value, f"the larger of: predicted {load:.0f} s × {TIMEOUT_FACTOR:g} (at least +{TIMEOUT_FLOOR_S} s), "
                         f"and the model server's own loading timeout {server_timeout_s} s (option.model_loading_timeout) "
                         f"+ {TIMEOUT_FLOOR_S} s; in whole minutes")


def size_deployment(plan: Plan, hardware: HardwareFacts, *, compressed: bool, server_timeout_s: int,
                    timeout_limit: int | None = PLATFORM_MAX_TIMEOUT_S) -> Sizing:
    """Size the deployment of `plan` on `hardware`; `compressed`: the model data is a model.tar.gz;
    `server_timeout_s`: how long the model server itself waits for the model to load (the start-up
    timeout must outlast it, or the platform kills a container that would have come up)."""
    d = plan.deployment
    tp, pp, dp = plan.tensor_parallel_degree, d.pipeline_parallel_degree, data_parallel_size(plan)
    artifact = plan.memory_per_device.weights * tp * pp * dp
    artifact_fig = Figure(artifact, f"the weights of one model copy as `lmc build` packs them: "
                                    f"{plan.memory_per_device.weights / GB:.2f} GB per rank × TP {tp}"
                                    + (f" × {dp} data-parallel groups (their attention is counted {dp} times: "
                                       "an upper bound)" if dp > 1 else "")
                                    + (f" × {pp} stages (the heaviest stage's ranks: an upper bound)" if pp > 1 else "")
                                    + " (plan.memory_per_device.weights); tokenizer and config files are small")
    rate = TAR_GZ_BYTES_PER_S if compressed else S3_PREFIX_BYTES_PER_S
    kind = "model.tar.gz (gunzip in one stream)" if compressed else "uncompressed S3 prefix"
    link = f"lmc's estimate for an {kind}, {rate / GB:g} GB/s"
    if hardware.network is not None and hardware.network.bandwidth_bytes_per_s < rate:
        rate = hardware.network.bandwidth_bytes_per_s
        link = f"the instance's network, {hardware.network.name} ({rate / GB:g} GB/s)"
    download = artifact / rate
    download_fig = Figure(round(download, 1), f"{artifact / GB:.1f} GB at {link}")
    load = plan.predicted.load_seconds
    load_fig = Figure(load, "plan.predicted.load_seconds: container start to every worker group ready")
    stored = artifact * (2 if compressed else 1) * STORAGE_HEADROOM
    storage_fig = Figure(int(math.ceil(stored)), f"the artifact {artifact / GB:.1f} GB"
                         + (" × 2 (the downloaded .tar.gz and its extracted tree)" if compressed else "")
                         + f" + {round((STORAGE_HEADROOM - 1) * 100)} % headroom")
    if hardware.instance_storage_bytes is not None:
        if stored > hardware.instance_storage_bytes:
            raise NoFeasiblePlanError(
                f"{hardware.name} has {hardware.instance_storage_bytes / GB:.0f} GB of instance storage; the model "
                f"needs {stored / GB:.0f} GB", ["serve it from an uncompressed S3 prefix, or use a larger instance"])
        ebs = None
    else:
        gb = int(math.ceil(stored / GB))
        if gb > MAX_EBS_VOLUME_GB:
            raise NoFeasiblePlanError(f"the model needs a {gb} GB volume; SageMaker allows {MAX_EBS_VOLUME_GB} GB",
                                      ["use an instance with NVMe instance storage (g5, p4d, p5)"])
        ebs = Figure(max(gb, 1), f"{storage_fig.reason}, in GB, on an EBS volume ({hardware.name} has no instance "
                                 "storage)")
    replicas_here = replicas_per_instance(plan)
    per_instance = min(hardware.devices, tp * dp * replicas_here)
    span = instances_per_copy_of(plan) // pp
    devices_fig = Figure(per_instance, f"TP {tp}" + (f" × DP {dp}" if dp > 1 else "")
                         + (f" = {tp * dp} ranks per copy, over {span} instances: all {hardware.devices} of each "
                            f"{hardware.name}" if span > 1 else
                            f" × {replicas_here} replica(s) per instance, of the {hardware.devices} of {hardware.name}"))
    shm = max(per_instance, 1) * SHM_PER_DEVICE_BYTES
    if hardware.host_memory_bytes is not None:
        shm = min(shm, hardware.host_memory_bytes // 2)
    shm_fig = Figure(shm, f"{SHM_PER_DEVICE_BYTES // GIB} GiB per device ({per_instance}) for NCCL/gloo buffers"
                          + (", at most half the host memory" if hardware.host_memory_bytes is not None else ""))
    per_minute = d.requests_per_second / max(d.instances, 1) * 60 * SCALING_UTILIZATION
    scaling_fig = Figure(round(max(per_minute, 0.01), 2),
                         f"{d.requests_per_second:g} requests/s over {d.instances} instance(s) "
                         f"(plan.deployment.requests_per_second) × 60 × {SCALING_UTILIZATION:g}: scale out at "
                         f"{round(SCALING_UTILIZATION * 100)} % of predicted capacity")
    return Sizing(
        artifact_bytes=artifact_fig,
        download_seconds=download_fig,
        download_timeout_s=timeout_for(download, "model download", timeout_limit),
        load_seconds=load_fig,
        startup_timeout_s=startup_timeout(load, server_timeout_s, timeout_limit),
        storage_bytes=storage_fig,
        ebs_volume_gb=ebs,
        shm_bytes=shm_fig,
        devices_per_instance=devices_fig,
        invocations_per_instance_per_minute=scaling_fig,
    )
