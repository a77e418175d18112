"""Deployment sizing: storage, timeouts, shared memory and the scaling target, from a plan. Pure.

Every figure carries the sentence that says where it came from; `lmc deploy` writes those into the
README beside the files. The plan already holds what the planner predicted (load time, requests
per second, instances); this module adds what the deployment files need on top of it:

- the artifact size: given by the caller (lmc.emitters.deploy): the sizes the built artifact's manifest
  lists, or what `lmc build` would pack for the plan (`planned_artifact` is the planned dtype's share:
  each rank's shard × TP × pipeline stages);
- the download time: the artifact over min(the instance's network, the transfer rate below);
- timeouts: the prediction with margin (×2 and at least +2 minutes), in whole minutes, never above
  what the platform allows (SageMaker: 3600 s) — past that the deployment cannot work and is refused;
- the storage: the artifact (and, for a .tar.gz, its extracted tree beside it) + 10 %,
  on the instance's NVMe where it has one (SageMaker takes no EBS volume there) or an EBS volume;
- a pod's CPU and memory requests: the instance's vCPUs and memory less what the node keeps for
  itself (one pod per instance);
- the rollout: a surge pod where the plan's peak has instances beyond its steady state, else one pod
  down at a time.
"""

from __future__ import annotations

import math
import re
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
MIB = 2**20
# What a Kubernetes node keeps from its pods (the EKS AMI's kubelet settings, amazon-eks-ami bootstrap):
# kube-reserved memory 255 MiB + 11 MiB per pod the node may run (110 at most, the kubelet's default cap),
# kube-reserved CPU 6 % of the first core, 1 % of the second, 0.5 % of the next two, 0.25 % of the rest;
# eviction at 100 MiB free. DAEMONSET_SHARE is lmc's allowance for the node's DaemonSets (CNI, kube-proxy,
# the device plugin, log and metrics agents) and the kernel's own reserve: an estimate, not a measurement.
KUBE_RESERVED_MEMORY_BYTES = 255 * MIB + 11 * MIB * 110
EVICTION_BYTES = 100 * MIB
DAEMONSET_SHARE = 0.10


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
    cpu_millicores: Figure | None  # a pod's CPU request; None where the instance's vCPUs are unknown
    memory_request_bytes: Figure | None  # a pod's memory request; None where the host memory is unknown
    surge: Figure  # 1: a rollout starts a new pod before stopping an old one; 0: one pod down at a time


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


def planned_artifact(plan: Plan) -> Figure:
    """The planned dtype's weights of one model copy: each rank's shard × TP (× DP groups × stages)."""
    tp, pp, dp = plan.tensor_parallel_degree, plan.deployment.pipeline_parallel_degree, data_parallel_size(plan)
    return Figure(plan.memory_per_device.weights * tp * pp * dp,
                  f"{plan.memory_per_device.weights / GB:.2f} GB per rank × TP {tp}"
                  + (f" × {dp} data-parallel groups (their attention is counted {dp} times: an upper bound)"
                     if dp > 1 else "")
                  + (f" × {pp} stages (the heaviest stage's ranks: an upper bound)" if pp > 1 else "")
                  + " (plan.memory_per_device.weights)")


def instance_vcpus(hardware: HardwareFacts) -> int | None:
    """vCPUs of an AWS instance from its size: `large` 2, `xlarge` 4, `Nxlarge` 4·N (the size names of the
    g4dn, g5, g6, g6e, p3, p4d, p5, inf2 and trn1 families, docs.aws.amazon.com/ec2/latest/instancetypes);
    None for anything else (the local host, a bare accelerator target)."""
    match = re.fullmatch(r"(?:ml\.)?[a-z0-9-]+\.(\d*)(x?)large", hardware.name)
    if match is None:
        return None
    count, x = match.groups()
    return 4 * int(count or 1) if x else 2


def kube_reserved_millicores(vcpus: int) -> int:
    """The EKS AMI's kube-reserved CPU for `vcpus` cores (6 %, 1 %, 0.5 % × 2, then 0.25 % each), in millicores."""
    shares = [60, 10, 5, 5] + [2.5] * max(vcpus - 4, 0)
    return math.ceil(sum(shares[:vcpus]))


def host_requests(hardware: HardwareFacts) -> tuple[Figure | None, Figure | None]:
    """A pod's CPU (millicores) and memory (bytes) requests when it has the instance to itself: what the node
    leaves its pods (lmc's DaemonSet share, then the kubelet's reserves), rounded down."""
    vcpus = instance_vcpus(hardware)
    cpu = None
    if vcpus is not None and hardware.kind != "cpu":
        reserved = kube_reserved_millicores(vcpus)
        value = int((vcpus * 1000 * (1 - DAEMONSET_SHARE) - reserved) // 100 * 100)
        cpu = Figure(value, f"{hardware.name}'s {vcpus} vCPUs less {round(DAEMONSET_SHARE * 100)} % for the node's "
                            f"DaemonSets and the EKS AMI's kube-reserved {reserved}m, in 100m steps")
    memory = None
    if hardware.host_memory_bytes is not None and hardware.kind != "cpu":
        value = int(hardware.host_memory_bytes * (1 - DAEMONSET_SHARE)) - KUBE_RESERVED_MEMORY_BYTES - EVICTION_BYTES
        value = value // GIB * GIB
        memory = Figure(value, f"{hardware.name}'s {hardware.host_memory_bytes / GIB:.0f} GiB less "
                               f"{round(DAEMONSET_SHARE * 100)} % for the kernel and the node's DaemonSets, the EKS "
                               f"AMI's kube-reserved {KUBE_RESERVED_MEMORY_BYTES // MIB} MiB (255 MiB + 11 MiB × 110 "
                               f"pods) and the {EVICTION_BYTES // MIB} MiB eviction threshold, in whole GiB")
    return cpu, memory


def rollout_surge(plan: Plan) -> Figure:
    """1 when the plan's peak needs more instances than it runs (plan.deployment.max_instances above its
    instances: the capacity for one more pod, or group of pods, is planned), so a rollout can start the new
    one before it stops an old one; else 0 (one down at a time: a single replica that fills its instances is
    down while its successor starts)."""
    d, nodes = plan.deployment, instances_per_copy_of(plan)
    spare = d.max_instances - d.instances
    group = " group" if nodes > 1 else ""
    if spare >= nodes:
        return Figure(1, f"the plan runs {d.instances} instance(s) and its peak {d.max_instances}: a new pod{group} "
                         "starts on a spare instance before an old one stops (maxSurge 1, maxUnavailable 0: no "
                         "capacity lost during a rollout)")
    return Figure(0, f"the plan's {d.instances} instance(s) are all its peak needs (autoscaling {d.min_instances}–"
                     f"{d.max_instances}) and each pod{group} fills its instance(s): no spare capacity is known, so a "
                     "rollout stops one before its successor starts (maxSurge 0, maxUnavailable 1)"
                  + ("; the single replica is down while the new one loads: with a node to spare, set maxSurge 1 "
                     "and maxUnavailable 0" if d.instances == 1 else
                     "; one replica's capacity is lost while its successor loads"))


def size_deployment(plan: Plan, hardware: HardwareFacts, *, compressed: bool, server_timeout_s: int,
                    artifact: Figure, unpacked: Figure | None = None,
                    timeout_limit: int | None = PLATFORM_MAX_TIMEOUT_S) -> Sizing:
    """Size the deployment of `plan` on `hardware`; `compressed`: the model data is a model.tar.gz;
    `artifact`: the bytes an instance downloads (the .tar.gz, or the tree of an S3 prefix), and `unpacked`
    the tree a .tar.gz extracts to (None: as large as the archive); `server_timeout_s`: how long the model
    server itself waits for the model to load (the start-up timeout must outlast it, or the platform kills
    a container that would have come up)."""
    d = plan.deployment
    tp, pp, dp = plan.tensor_parallel_degree, d.pipeline_parallel_degree, data_parallel_size(plan)
    artifact_fig = artifact
    artifact = int(artifact.value)
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
    extracted = int(unpacked.value) if unpacked is not None else artifact
    stored = (artifact + (extracted if compressed else 0)) * STORAGE_HEADROOM
    storage_fig = Figure(int(math.ceil(stored)), f"the artifact {artifact / GB:.1f} GB"
                         + ((" + its extracted tree " + (f"{extracted / GB:.1f} GB" if unpacked is not None else
                                                         "as large (weights barely compress)"))
                            if compressed else "")
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
    cpu_fig, memory_fig = host_requests(hardware)
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
        cpu_millicores=cpu_fig,
        memory_request_bytes=memory_fig,
        surge=rollout_surge(plan),
    )
