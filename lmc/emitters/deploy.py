"""Deployment files from a plan: SageMaker request bodies, Kubernetes manifests, a KServe InferenceService
(with its ServingRuntime for a vLLM plan across instances).

Pure: a Plan, its hardware facts and the deployment's account values in; {relative path: bytes}
out. The numbers come from the plan and lmc.planner.sizing (which says where each came from); this
module lays them out in each API's shape. Where the spec and flags leave an account value unset
(image, role, model data), the files carry a placeholder that contains REPLACE_ME and still has
the value's shape, and `placeholders` names them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from lmc.errors import NoFeasiblePlanError
from lmc.emitters import yaml_text
from lmc.planner.facts import HardwareFacts
from lmc.planner.plan import Plan
from lmc.planner.facts import DTYPE_BYTES
from lmc.planner.sizing import (GB, GIB, PLATFORM_MAX_TIMEOUT_S, Figure, Sizing, copy_layout,
                                 data_parallel_size, instances_per_copy_of, planned_artifact, replicas_per_instance,
                                 size_deployment)

TARGETS = ("sagemaker", "kubernetes", "kserve")
PLACEHOLDER = "REPLACE_ME"
PORT = 8080
# vLLM across instances (lmc.runtime.vllm_nodes): vLLM's torch.distributed master and lmc's lifeline, on the leader.
VLLM_MASTER_PORT = 29501
# vLLM's data-parallel RPC port (ParallelConfig.data_parallel_rpc_port, which lmc leaves at vLLM's default):
# a data-parallel plan across instances has the worker nodes' engines hand-shake with the leader there.
VLLM_DP_RPC_PORT = 29550
LIFELINE_PORT = 29510
EFA_LINK_BPS = 100e9  # one EFA device: 100 Gbps (p4d: 4 of them, p5/p5en: 32)
MODEL_DIR = "/opt/ml/model"
KSERVE_MODEL_DIR = "/mnt/models"  # where KServe's storage initializer puts STORAGE_URI
VARIANT = "AllTraffic"
PROBE_PERIOD_S = 10
SCALE_IN_COOLDOWN_S = 600
# The AWS CLI's official image, pinned (a tag seen pinned in public manifests, 2026; Amazon ECR Public keeps
# every version's tag: `aws ecr-public describe-image-tags --repository-name aws-cli/aws-cli` lists newer).
DOWNLOADER_IMAGE = "public.ecr.aws/aws-cli/aws-cli:2.36.44"
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"  # the role a service account's pods assume (EKS IRSA)
NEURON_CORES_PER_DEVICE = 2  # Inferentia2 and Trainium: two NeuronCores per device (aws.amazon.com/neuron)
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


@dataclass(frozen=True)
class Account:
    """Account-specific values: from the spec's [deploy] section or flags; None where neither gives one."""

    name: str
    image: str | None = None
    role_arn: str | None = None
    model_data: str | None = None
    service_account: str | None = None

    def placeholders(self, target: str) -> list[str]:
        """The values `target`'s files carry as placeholders, as `[deploy]` keys."""
        return [key for key in ("image", "role_arn", "model_data") if getattr(self, key) is None]

    @property
    def service_account_name(self) -> str:
        """The Kubernetes service account the pods read the model data as ([deploy] service_account, else the name)."""
        return self.service_account or self.name

    @property
    def image_or_placeholder(self) -> str:
        return self.image or f"{PLACEHOLDER}.dkr.ecr.region.amazonaws.com/lmc-runtime:{PLACEHOLDER}"

    @property
    def role_or_placeholder(self) -> str:
        return self.role_arn or f"arn:aws:iam::000000000000:role/{PLACEHOLDER}-sagemaker-execution-role"

    @property
    def pod_role_or_placeholder(self) -> str:
        """The IAM role the service account's pods assume to read the model data (IRSA)."""
        return self.role_arn or f"arn:aws:iam::000000000000:role/{PLACEHOLDER}-model-data-reader"

    @property
    def model_data_or_placeholder(self) -> str:
        return self.model_data or f"s3://{PLACEHOLDER.lower().replace('_', '-')}-bucket/lmc/{self.name}/model/"

    @property
    def compressed(self) -> bool:
        """A model.tar.gz (downloaded, then extracted), else an uncompressed S3 prefix (`lmc build --format dir`)."""
        return self.model_data_or_placeholder.endswith(".tar.gz")


def resource_name(text: str) -> str:
    """A DNS-1123 label from `text` (lower case, digits, '-'; at most 63), for names of every kind."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:63].strip("-")
    return name or "lmc-model"


@dataclass(frozen=True)
class BuiltArtifact:
    """What `lmc build` wrote, from its manifest (lmc.json): the plan it was built from, its files' total and,
    for a model.tar.gz, the archive's own size."""

    path: str
    plan_sha256: str
    tree_bytes: int
    archive_bytes: int | None  # None for a directory (`lmc build --format dir`)


def read_built_artifact(path: str) -> BuiltArtifact:
    """The manifest of the artifact at `path` (a directory or a model.tar.gz). Raises ArtifactError."""
    import tarfile
    from pathlib import Path

    from lmc.errors import ArtifactError
    from lmc.manifest import MANIFEST_NAME, read_manifest

    where = Path(path)
    if where.is_dir():
        manifest, archive = read_manifest(where), None
        own = (where / MANIFEST_NAME).stat().st_size
    else:
        import tempfile

        try:
            with tarfile.open(where, "r:gz") as tar:
                member = next((m for m in tar if m.name.lstrip("./") == MANIFEST_NAME and m.isfile()), None)
                if member is None:
                    raise ArtifactError(f"{path}: no {MANIFEST_NAME} in the archive; is it an artifact built by `lmc build`?")
                data = tar.extractfile(member).read()
        except (OSError, tarfile.TarError, EOFError) as exc:
            raise ArtifactError(f"{path}: not a readable artifact (a directory or a model.tar.gz): {exc}") from None
        with tempfile.TemporaryDirectory() as scratch:  # read_manifest's checks, on a file of its own
            (Path(scratch) / MANIFEST_NAME).write_bytes(data)
            manifest = read_manifest(Path(scratch))
        archive, own = where.stat().st_size, len(data)
    sha = manifest["plan"].get("plan_sha256")
    tree = own + sum(entry["size"] for entry in manifest["files"].values())  # every file but lmc.json, and it
    return BuiltArtifact(path=path, plan_sha256=str(sha), tree_bytes=tree, archive_bytes=archive)


def predicted_artifact(plan: Plan) -> Figure:
    """What `lmc build` packs for `plan` (lmc.emitters.build): the shards in the planned dtype for hf and
    DeepSpeed; for neuronx the whole checkpoint cast to the planned dtype (fp16 for int8, which the Neuron SDK
    quantizes as it loads); for vLLM either vLLM's sharded_state (a build host with the plan's GPUs: the
    planned dtype) or the whole checkpoint in 16 bits for fp8 (any other build host, and every CPU plan):
    the larger of the two, since the deploy files cannot know where the build runs."""
    from lmc.emitters.vllm_weights import packed_dtype

    planned = planned_artifact(plan)
    if plan.engine == "neuronx":
        dtype = "fp16" if plan.dtype == "int8" else plan.dtype
        whole = int(plan.model.parameters * DTYPE_BYTES[dtype])
        return Figure(whole, f"the whole checkpoint in {dtype} as `lmc build` packs it for neuronx: "
                             f"{plan.model.parameters / 1e9:.2f} B parameters × {DTYPE_BYTES[dtype]:g} bytes")
    dtype = packed_dtype(plan) if plan.engine == "vllm" else None
    if dtype is None:  # hf, DeepSpeed: the shards; a quantized checkpoint: its files as they are
        return Figure(planned.value, f"the weights of one model copy as `lmc build` packs them: {planned.reason}")
    whole = int(plan.model.parameters * DTYPE_BYTES[dtype])
    checkpoint = (f"the checkpoint in {dtype} as model.safetensors, {whole / GB:.1f} GB "
                  f"({plan.model.parameters / 1e9:.2f} B parameters × {DTYPE_BYTES[dtype]:g} bytes)")
    if plan.target.accelerator == "cpu":
        return Figure(whole, f"{checkpoint}: what `lmc build` packs for vLLM on CPU")
    if whole >= planned.value:
        return Figure(whole, f"{checkpoint}: what `lmc build` packs on a build host without the plan's {plan.tensor_parallel_degree} "
                             f"CUDA GPU(s); on one with them, vLLM's sharded_state in {plan.dtype}, "
                             f"{planned.value / GB:.1f} GB ({planned.reason}); sized for the larger: give "
                             "`--artifact` to size from the built one")
    return Figure(planned.value, f"vLLM's sharded_state in {plan.dtype}, {planned.reason}, on a build host with "
                                 f"the GPUs; elsewhere {checkpoint}; sized for the larger: give `--artifact` to size "
                                 "from the built one")


def artifact_figures(plan: Plan, account: Account, built: BuiltArtifact | None) -> tuple[Figure, Figure | None]:
    """(the bytes an instance downloads, the tree a .tar.gz extracts to): from the built artifact's manifest
    when given, else predicted. Raises ArtifactError when the artifact was built from another plan."""
    if built is None:
        return predicted_artifact(plan), None
    from lmc.errors import ArtifactError

    if built.plan_sha256 != plan.plan_sha256:
        raise ArtifactError(f"{built.path}: built from plan {built.plan_sha256[:12]}, not this spec's plan "
                            f"{plan.plan_sha256[:12]}: build the spec again, or give its artifact")
    tree = Figure(built.tree_bytes, f"the files {built.path}'s manifest (lmc.json) lists, {built.tree_bytes / GB:.2f} GB")
    if account.compressed and built.archive_bytes is not None:
        return Figure(built.archive_bytes, f"{built.path} as built, {built.archive_bytes / GB:.2f} GB"), tree
    return tree, (tree if account.compressed else None)


def render_deployment(target: str, plan: Plan, hardware: HardwareFacts, account: Account,
                      built: BuiltArtifact | None = None) -> dict[str, bytes]:
    """The files for `target`, README.md included; sized from `built` (the artifact's manifest) when given,
    else from what the build would pack. Raises NoFeasiblePlanError when the target cannot run the plan (a
    pipeline across instances on SageMaker, a timeout past the platform's limit)."""
    if target not in TARGETS:
        raise ValueError(f"unknown deploy target {target!r}")
    if target == "sagemaker":
        check_sagemaker(plan, hardware)
    elif target == "kserve":
        check_kserve(plan, hardware)
    # Only SageMaker caps the timeouts (Kubernetes has no such limit).
    limit = PLATFORM_MAX_TIMEOUT_S if target == "sagemaker" else None
    artifact, unpacked = artifact_figures(plan, account, built)
    sizing = size_deployment(plan, hardware, compressed=account.compressed, server_timeout_s=server_timeout(plan),
                             artifact=artifact, unpacked=unpacked, timeout_limit=limit)
    emit = {"sagemaker": sagemaker_files, "kubernetes": kubernetes_files, "kserve": kserve_files}[target]
    files = emit(plan, hardware, account, sizing)
    files[f"{target}/README.md"] = readme(target, plan, hardware, account, sizing, files).encode()
    return dict(sorted(files.items()))


def server_timeout(plan: Plan) -> int:
    from lmc.emitters.render import loading_timeout_seconds

    return loading_timeout_seconds(plan.predicted.load_seconds)


# KServe's multi-node InferenceService (predictor.workerSpec, KServe 0.15+) runs vLLM on a Ray cluster: the
# controller starts a head Deployment (RAY_NODE_COUNT, TENSOR_PARALLEL_SIZE, PIPELINE_PARALLEL_SIZE in its env)
# and RAY_NODE_COUNT - 1 workers (HEAD_SVC names the head's headless Service), from a ServingRuntime that has a
# workerSpec (config/runtimes/kserve-huggingfaceserver-multinode.yaml in KServe). lmc's runtime plays both parts
# (lmc.runtime.vllm_ray): the head starts Ray's head, waits for the nodes and serves; a worker joins the head.
RAY_PORT = 6379
KSERVE_MODEL_FORMAT = "lmc"
# Raw deployment, and no HPA: lmc fixes the replicas at the plan's instances (min = max), and KServe 0.15's
# autoscaler class "none" creates no HorizontalPodAutoscaler for them (kserve.github.io/website/0.15/modelserving/
# autoscaling/raw_deployment_autoscaling, "Disable HPA in Raw Deployment").
KSERVE_RAW = {"serving.kserve.io/deploymentMode": "RawDeployment", "serving.kserve.io/autoscalerClass": "none"}


def check_kserve(plan: Plan, hardware: HardwareFacts) -> None:
    nodes = instances_per_copy_of(plan)
    if nodes <= 1:
        return
    if data_parallel_size(plan) > 1:
        raise NoFeasiblePlanError(
            f"KServe cannot run this plan: its multi-node InferenceService runs vLLM's TP × PP on Ray, and the plan's "
            f"{copy_layout(plan)} spreads data-parallel groups over {nodes} instances (vLLM's multiprocessing DP, "
            "which lmc runs on LeaderWorkerSet)", ["use --target kubernetes (a LeaderWorkerSet)"])
    copies = plan.deployment.instances // nodes
    if copies > 1:
        raise NoFeasiblePlanError(
            f"KServe cannot run this plan: its multi-node InferenceService is one Ray cluster serving one model copy, "
            f"and the plan runs {copies} copies of {nodes} instances",
            [f"deploy {copies} InferenceServices, or use --target kubernetes (a LeaderWorkerSet of {copies} groups)"])
    if hardware.kind != "gpu":
        raise NoFeasiblePlanError(
            f"KServe cannot run this plan: its multi-node InferenceService runs vLLM on Ray, and vLLM's "
            f"{hardware.kind} platform does not run on Ray", ["use --target kubernetes (a LeaderWorkerSet)"])


def check_single_node(plan: Plan, platform: str, why: str) -> None:
    nodes = instances_per_copy_of(plan)
    if nodes > 1:
        raise NoFeasiblePlanError(
            f"{platform} cannot run this plan: it lays each model copy ({copy_layout(plan)}) on {nodes} "
            f"instances, and {why}", ["use --target kubernetes (a LeaderWorkerSet of each copy's instances)"])


def check_sagemaker(plan: Plan, hardware: HardwareFacts) -> None:
    check_single_node(plan, "SageMaker", "each endpoint instance serves a whole model copy on its own")
    if not hardware.name.startswith("ml."):
        raise NoFeasiblePlanError(
            f"SageMaker cannot run this plan: an endpoint needs an ml.* instance type; this plan targets {hardware.name}",
            ["name a catalog instance in target.instance (ml.g5.12xlarge, ...), or use --target kubernetes"])
    if not hardware.sagemaker_hosting:
        raise NoFeasiblePlanError(
            f"SageMaker cannot run this plan: {hardware.name} is a training instance type, which SageMaker does not "
            "offer for endpoints (CreateEndpointConfig's ProductionVariantInstanceType)",
            ["plan another instance in target.instance (ml.p3.16xlarge, ml.p4d.24xlarge, ...), or use --target "
             "kubernetes on EC2 instances of the type"])


# --- SageMaker ----------------------------------------------------------------------------------------

def sagemaker_files(plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing) -> dict[str, bytes]:
    name, d = account.name, plan.deployment
    resource_id = f"endpoint/{name}/variant/{VARIANT}"
    if account.compressed:
        container = {"Image": account.image_or_placeholder, "ModelDataUrl": account.model_data_or_placeholder}
    else:
        container = {"Image": account.image_or_placeholder,
                     "ModelDataSource": {"S3DataSource": {"S3Uri": account.model_data_or_placeholder,
                                                          "S3DataType": "S3Prefix", "CompressionType": "None"}}}
    container["Environment"] = container_environment(plan)
    variant = {
        "VariantName": VARIANT,
        "ModelName": name,
        "InstanceType": hardware.name,
        "InitialInstanceCount": d.instances,
    }
    if sizing.ebs_volume_gb is not None:
        variant["VolumeSizeInGB"] = sizing.ebs_volume_gb.value
    variant["ModelDataDownloadTimeoutInSeconds"] = sizing.download_timeout_s.value
    variant["ContainerStartupHealthCheckTimeoutInSeconds"] = sizing.startup_timeout_s.value
    scale_out = int(min(sizing.download_timeout_s.value + sizing.startup_timeout_s.value, 3600))
    bodies = {
        "create-model.json": {"ModelName": name, "ExecutionRoleArn": account.role_or_placeholder,
                              "PrimaryContainer": container},
        "create-endpoint-config.json": {"EndpointConfigName": name, "ProductionVariants": [variant]},
        "create-endpoint.json": {"EndpointName": name, "EndpointConfigName": name},
    }
    if d.min_instances < d.max_instances:  # nothing to scale where the bounds are equal
        bodies["register-scalable-target.json"] = {
            "ServiceNamespace": "sagemaker", "ResourceId": resource_id,
            "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
            "MinCapacity": d.min_instances, "MaxCapacity": d.max_instances}
        bodies["put-scaling-policy.json"] = {
            "PolicyName": f"{name}-invocations-per-instance", "ServiceNamespace": "sagemaker",
            "ResourceId": resource_id, "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
            "PolicyType": "TargetTrackingScaling",
            "TargetTrackingScalingPolicyConfiguration": {
                "TargetValue": sizing.invocations_per_instance_per_minute.value,
                "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"},
                "ScaleInCooldown": SCALE_IN_COOLDOWN_S,
                "ScaleOutCooldown": scale_out}}
    return {f"sagemaker/{file}": (json.dumps(body, indent=2) + "\n").encode() for file, body in bodies.items()}


def container_environment(plan: Plan) -> dict[str, str]:
    """The container's environment: the LMI container reads serving.properties from the artifact, so
    only what binds the deployment to its plan and the model server's start-up patience."""
    return {
        "LMC_PLAN_SHA256": plan.plan_sha256,
        # LMI reads OPTION_* variables as option.* properties: the same model-loading timeout as the
        # artifact's serving.properties, so a container that reads only the environment waits as long.
        "OPTION_MODEL_LOADING_TIMEOUT": str(server_timeout(plan)),
    }


# --- Kubernetes ---------------------------------------------------------------------------------------

def device_resources(plan: Plan, hardware: HardwareFacts, sizing: Sizing) -> dict[str, str]:
    devices = int(sizing.devices_per_instance.value)
    if hardware.kind == "gpu":
        return {"nvidia.com/gpu": str(devices)}
    if hardware.kind == "neuron":
        return {"aws.amazon.com/neuron": str(math.ceil(devices / NEURON_CORES_PER_DEVICE))}
    return {}


def _quantity(n: int) -> str:
    """A Kubernetes quantity in Gi (rounded up)."""
    return f"{max(math.ceil(n / GIB), 1)}Gi"


def _startup_failures(sizing: Sizing) -> int:
    """The startup probe's failureThreshold: as many periods as the start-up timeout."""
    return math.ceil(sizing.startup_timeout_s.value / PROBE_PERIOD_S)


def _probes(sizing: Sizing) -> dict:
    startup_failures = _startup_failures(sizing)
    ping = {"path": "/ping", "port": PORT}
    return {
        "startupProbe": {"httpGet": ping, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": startup_failures,
                         "timeoutSeconds": 5},
        "readinessProbe": {"httpGet": ping, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 3,
                           "timeoutSeconds": 5},
        "livenessProbe": {"httpGet": ping, "periodSeconds": 30, "failureThreshold": 5, "timeoutSeconds": 10},
    }


def _pod_spec(plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing, *, serves: bool,
              model_dir: str = MODEL_DIR, download: bool = True) -> dict:
    resources = device_resources(plan, hardware, sizing)
    limits = dict(resources)
    requests = {**resources, "ephemeral-storage": _quantity(int(sizing.storage_bytes.value))}
    if sizing.cpu_millicores is not None:
        requests["cpu"] = f"{int(sizing.cpu_millicores.value)}m"
    if hardware.kind == "cpu":  # the ranks share the host's memory: what the plan puts in it
        requests["memory"] = _quantity(plan.memory_per_device.total * plan.tensor_parallel_degree
                                       * replicas_per_instance(plan))
    elif sizing.memory_request_bytes is not None:
        requests["memory"] = _quantity(int(sizing.memory_request_bytes.value))
    container = {
        "name": "lmc-runtime",
        "image": account.image_or_placeholder,
        "command": ["lmc", "runtime"],
        "args": ["--model-dir", model_dir, "--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": [{"name": "LMC_PLAN_SHA256", "value": plan.plan_sha256}],
        "resources": {"requests": requests, **({"limits": limits} if limits else {})},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if not serves:
        container.pop("ports")
    else:
        container.update(_probes(sizing))
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _quantity(int(sizing.shm_bytes.value))}}]
    spec: dict = {"serviceAccountName": account.service_account_name}
    if download:
        container["volumeMounts"].append({"name": "model", "mountPath": model_dir, "readOnly": True})
        volumes.append({"name": "model", "emptyDir": {"sizeLimit": _quantity(int(sizing.storage_bytes.value))}})
        spec["initContainers"] = [download_container(account, model_dir)]
    spec["containers"] = [container]
    spec["volumes"] = volumes
    spec["terminationGracePeriodSeconds"] = 120
    if hardware.name.startswith("ml."):
        spec["nodeSelector"] = {"node.kubernetes.io/instance-type": hardware.name[3:]}
    if hardware.kind == "gpu":
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    elif hardware.kind == "neuron":
        spec["tolerations"] = [{"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def _leader_spec(plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing) -> dict:
    """The leader serves HTTP and hosts the group's rendezvous (named, for network policies): vLLM's
    torch.distributed master and lmc's lifeline."""
    spec = _group_pod(plan, hardware, account, sizing, serves=True)
    spec["containers"][0]["ports"] += [{"name": "vllm-master", "containerPort": VLLM_MASTER_PORT, "protocol": "TCP"},
                                       {"name": "lifeline", "containerPort": LIFELINE_PORT, "protocol": "TCP"}]
    if data_parallel_size(plan) > 1:  # the other nodes' engines hand-shake with the leader's front end here
        spec["containers"][0]["ports"].append({"name": "vllm-dp-rpc", "containerPort": VLLM_DP_RPC_PORT,
                                               "protocol": "TCP"})
    return spec


def efa_devices(hardware: HardwareFacts) -> int:
    """The instance's EFA devices (its EFA bandwidth in 100 Gbps devices); 0 without EFA or GPUs."""
    network = hardware.network
    if hardware.kind != "gpu" or network is None or not network.name.startswith("EFA"):
        return 0
    return max(round(network.bandwidth_bytes_per_s * 8 / EFA_LINK_BPS), 1)


def _group_pod(plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing, *, serves: bool,
               model_dir: str = MODEL_DIR, download: bool = True) -> dict:
    """A pod of a group across instances: the instance's EFA devices and NCCL's settings for them (libfabric
    over EFA with GPUDirect RDMA, which p4d and p5 have), so the stages' hand-overs go over EFA, not TCP."""
    spec = _pod_spec(plan, hardware, account, sizing, serves=serves, model_dir=model_dir, download=download)
    if efa_devices(hardware):
        container = spec["containers"][0]
        efa = str(efa_devices(hardware))
        for key in ("requests", "limits"):
            container["resources"].setdefault(key, {})["vpc.amazonaws.com/efa"] = efa
        container["env"] += [{"name": "FI_PROVIDER", "value": "efa"},
                             {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"},
                             {"name": "NCCL_PROTO", "value": "simple"}]
    return spec


def download_container(account: Account, model_dir: str) -> dict:
    """Fetches the artifact before the runtime starts (credentials: the pod's service account)."""
    source = account.model_data_or_placeholder
    if account.compressed:
        command = f"aws s3 cp '{source}' - | tar -xz -C '{model_dir}'"
    else:
        command = f"aws s3 sync '{source}' '{model_dir}'"
    return {"name": "fetch-model", "image": DOWNLOADER_IMAGE, "command": ["/bin/sh", "-c", command],
            "volumeMounts": [{"name": "model", "mountPath": model_dir}]}


def _labels(account: Account) -> dict[str, str]:
    return {"app.kubernetes.io/name": account.name, "app.kubernetes.io/managed-by": "lmc"}


def _annotations(plan: Plan) -> dict[str, str]:
    """The plan the pods serve: a new plan changes the pod template, so the pods roll."""
    return {"lmc/plan-sha256": plan.plan_sha256}


def kubernetes_files(plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing) -> dict[str, bytes]:
    name, d = account.name, plan.deployment
    labels = _labels(account)
    selector = {"app.kubernetes.io/name": name}
    nodes = instances_per_copy_of(plan)
    if nodes > 1:
        template = {"metadata": {"labels": labels, "annotations": _annotations(plan)}}
        workload = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": d.instances // nodes,
                "startupPolicy": "LeaderCreated",
                "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": _rolling_update(sizing)},
                "leaderWorkerTemplate": {
                    "size": nodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {**template, "spec": _leader_spec(plan, hardware, account, sizing)},
                    "workerTemplate": {**template, "spec": _group_pod(plan, hardware, account, sizing, serves=False)},
                },
            },
        }
        service_selector = {LWS_NAME_LABEL: name, LWS_INDEX_LABEL: "0"}
        workload_file = "kubernetes/leaderworkerset.yaml"
    else:
        workload = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": d.instances,
                "selector": {"matchLabels": selector},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": _rolling_update(sizing)},
                "template": {"metadata": {"labels": labels, "annotations": _annotations(plan)},
                             "spec": _pod_spec(plan, hardware, account, sizing, serves=True)},
            },
        }
        service_selector = selector
        workload_file = "kubernetes/deployment.yaml"
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"selector": service_selector, "ports": [{"name": "http", "port": PORT, "targetPort": PORT,
                                                           "protocol": "TCP"}]},
    }
    return {workload_file: (_comment(f"rollout: {sizing.surge.reason}") + yaml_text.dump(workload)).encode(),
            "kubernetes/service.yaml": yaml_text.dump(service).encode(),
            "kubernetes/serviceaccount.yaml": service_account_yaml(account).encode()}


def _rolling_update(sizing: Sizing) -> dict[str, int]:
    """A surge pod where the plan leaves an instance for it, else one pod down at a time (sizing.rollout_surge)."""
    surge = int(sizing.surge.value)
    return {"maxUnavailable": 1 - surge, "maxSurge": surge}


def _comment(text: str) -> str:
    """`text` as YAML comment lines at the top of a file."""
    import textwrap

    return "".join(f"# {line}\n" for line in textwrap.wrap(text, 100, break_on_hyphens=False))


def service_account_yaml(account: Account) -> str:
    """The service account the pods run as: its IAM role (EKS IRSA's annotation) reads the model data."""
    document = {"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": account.service_account_name, "labels": _labels(account),
                             "annotations": {IRSA_ANNOTATION: account.pod_role_or_placeholder}}}
    return (_comment("The pods' identity for reading the model data: IRSA assumes the annotated role; with EKS Pod "
                     "Identity instead, associate a role with this service account "
                     "(aws eks create-pod-identity-association) and the annotation is ignored.")
            + yaml_text.dump(document))


# --- KServe -------------------------------------------------------------------------------------------

def kserve_files(plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing) -> dict[str, bytes]:
    d = plan.deployment
    if instances_per_copy_of(plan) > 1:
        return kserve_multinode_files(plan, hardware, account, sizing)
    pod = _pod_spec(plan, hardware, account, sizing, serves=True, model_dir=KSERVE_MODEL_DIR, download=False)
    container = pod["containers"][0]
    container["name"] = "kserve-container"  # the name KServe's storage initializer mounts /mnt/models into
    container["env"].append({"name": "STORAGE_URI", "value": account.model_data_or_placeholder})
    # Raw deployment mode scales with an HPA on CPU or memory, which do not follow accelerator load:
    # the replicas are fixed at the plan's instances (the README gives the peak bound for KEDA).
    predictor = {"minReplicas": d.instances, "maxReplicas": d.instances, **pod}
    isvc = {
        "apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
        "metadata": {"name": account.name, "labels": _labels(account),
                     "annotations": {**KSERVE_RAW, **_annotations(plan)}},
        "spec": {"predictor": predictor},
    }
    return {"kserve/inferenceservice.yaml": yaml_text.dump(isvc).encode(),
            "kserve/serviceaccount.yaml": service_account_yaml(account).encode()}


def kserve_multinode_files(plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing) -> dict[str, bytes]:
    """A vLLM plan across instances on KServe: a ServingRuntime with a workerSpec (the head's container and the
    workers', both `lmc runtime` on the artifact KServe's storage initializer puts in /mnt/models) and the
    InferenceService that names it, with the plan's TP and PP (KServe runs PP nodes of TP GPUs each)."""
    sizes = {"pipelineParallelSize": plan.deployment.pipeline_parallel_degree,
             "tensorParallelSize": plan.tensor_parallel_degree}
    ray_env = [{"name": "RAY_PORT", "value": str(RAY_PORT)},
               {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
               {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    head = _group_pod(plan, hardware, account, sizing, serves=True, model_dir=KSERVE_MODEL_DIR, download=False)
    worker = _group_pod(plan, hardware, account, sizing, serves=False, model_dir=KSERVE_MODEL_DIR, download=False)
    for pod, name in ((head, "kserve-container"), (worker, "worker-container")):  # the names KServe looks for
        container = pod["containers"][0]
        container["name"] = name
        container["env"] += ray_env
        pod.pop("terminationGracePeriodSeconds")  # not a ServingRuntime field: the InferenceService sets it
        pod.pop("serviceAccountName")  # likewise
    head["containers"][0]["ports"].append({"name": "ray-gcs", "containerPort": RAY_PORT, "protocol": "TCP"})
    runtime = {
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntime",
        "metadata": {"name": account.name, "labels": _labels(account), "annotations": _annotations(plan)},
        "spec": {
            "supportedModelFormats": [{"name": KSERVE_MODEL_FORMAT, "version": "1", "autoSelect": False}],
            "multiModel": False,
            **head,
            "workerSpec": {**sizes, **worker},
        },
    }
    isvc = {
        "apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
        "metadata": {"name": account.name, "labels": _labels(account),
                     "annotations": {**KSERVE_RAW, **_annotations(plan)}},
        "spec": {"predictor": {
            "model": {"modelFormat": {"name": KSERVE_MODEL_FORMAT}, "runtime": account.name,
                      "storageUri": account.model_data_or_placeholder},
            "serviceAccountName": account.service_account_name,
            "terminationGracePeriodSeconds": 120,
            "workerSpec": {**sizes, "serviceAccountName": account.service_account_name,
                           "terminationGracePeriodSeconds": 120},
        }},
    }
    return {"kserve/servingruntime.yaml": yaml_text.dump(runtime).encode(),
            "kserve/inferenceservice.yaml": yaml_text.dump(isvc).encode(),
            "kserve/serviceaccount.yaml": service_account_yaml(account).encode()}


# --- README -------------------------------------------------------------------------------------------

def readme(target: str, plan: Plan, hardware: HardwareFacts, account: Account, sizing: Sizing,
           files: dict[str, bytes]) -> str:
    d, p = plan.deployment, plan.predicted
    lines = [f"# {account.name}: {target} deployment of {plan.model.id}", "",
             f"Written by `lmc deploy --target {target}` from plan {plan.plan_sha256[:12]} (spec "
             f"{plan.spec_sha256[:12]}). Do not edit: change the spec and run `lmc deploy` again.", "",
             "## Files", ""]
    lines += [f"- `{path.split('/', 1)[1]}`{_describe_file(path)}" for path in sorted(files)]
    lines += ["", "## Where each number comes from", "",
              f"- instance type {hardware.name}, {d.instances} instance(s): the plan ({plan.engine} {plan.dtype}, "
              f"{copy_layout(plan)}, {plan.replicas} replica(s)); `lmc plan --explain` says why",
              f"- autoscaling {d.min_instances}–{d.max_instances} instance(s): plan.deployment (the workload's "
              "requests_per_second and peak_requests_per_second, or the instances the plan uses)"
              + ("" if d.min_instances < d.max_instances or target != "sagemaker" else
                 "; equal bounds, so no scaling target or policy is written"),
              f"- artifact {sizing.artifact_bytes.value / GB:.1f} GB: {sizing.artifact_bytes.reason}",
              f"- storage per instance {sizing.storage_bytes.value / GB:.1f} GB: {sizing.storage_bytes.reason}"]
    if sizing.ebs_volume_gb is not None:
        lines.append(f"- VolumeSizeInGB {sizing.ebs_volume_gb.value}: {sizing.ebs_volume_gb.reason}")
    elif hardware.instance_storage_bytes is not None:
        lines.append(f"- no VolumeSizeInGB: {hardware.name} has {hardware.instance_storage_bytes / GB:.0f} GB of NVMe "
                     "instance storage, where SageMaker puts the model (it takes no EBS volume there)")
    download = (f"timeout {sizing.download_timeout_s.value} s: {sizing.download_timeout_s.reason}"
                if target == "sagemaker" else "fetched before the runtime starts, with no timeout")
    lines += [f"- download {sizing.download_seconds.value:g} s predicted: {sizing.download_seconds.reason}; "
              f"{download}",
              f"- load {sizing.load_seconds.value:g} s predicted: {sizing.load_seconds.reason}; start-up timeout "
              f"{sizing.startup_timeout_s.value} s: {sizing.startup_timeout_s.reason}"]
    if target == "kserve" and d.max_instances > d.instances:
        lines.append(f"- replicas fixed at {d.instances}: KServe's raw-deployment autoscaler (an HPA) scales on CPU or "
                     f"memory, which do not follow accelerator load; the peak needs {d.max_instances} (scale on "
                     "request rate with KEDA, or use --target sagemaker)")
    if target != "sagemaker":
        lines += [f"- startup probe: every {PROBE_PERIOD_S} s, {_startup_failures(sizing)} "
                  "failures allowed = the start-up timeout; readiness and liveness on `/ping`",
                  f"- devices per pod {sizing.devices_per_instance.value}: {sizing.devices_per_instance.reason}",
                  f"- /dev/shm {sizing.shm_bytes.value / GIB:.0f} GiB: {sizing.shm_bytes.reason}"]
        if sizing.cpu_millicores is not None:
            lines.append(f"- CPU request {int(sizing.cpu_millicores.value)}m: {sizing.cpu_millicores.reason} "
                         "(the pod has the instance to itself)")
        if hardware.kind == "cpu":
            lines.append(f"- memory request: the plan's memory per rank ({plan.memory_per_device.total / GIB:.1f} GiB) "
                         f"× TP {plan.tensor_parallel_degree} × {replicas_per_instance(plan)} replica(s): the ranks "
                         "share the host's memory")
        elif sizing.memory_request_bytes is not None:
            lines.append(f"- memory request {sizing.memory_request_bytes.value / GIB:.0f} GiB: "
                         f"{sizing.memory_request_bytes.reason}")
        lines.append(f"- service account {account.service_account_name}: the pods' identity for the model data "
                     + ("(`[deploy] service_account`)" if account.service_account else
                        "(the resource name; `[deploy] service_account` or --service-account names another)")
                     + f"; its role ({IRSA_ANNOTATION}): `[deploy] role_arn`")
        if target == "kubernetes":
            lines.append(f"- rollout maxSurge {int(sizing.surge.value)}, maxUnavailable {1 - int(sizing.surge.value)}: "
                         f"{sizing.surge.reason}")
        nodes = instances_per_copy_of(plan)
        if nodes > 1 and efa_devices(hardware):
            carried = ("the stages' hand-overs" if d.pipeline_parallel_degree > 1 else
                       "the experts' all-gathers and reduce-scatters between the instances")
            lines.append(f"- EFA {efa_devices(hardware)} device(s) per pod: {hardware.network.name} of {hardware.name} "
                         f"in 100 Gbps devices; NCCL over libfabric (FI_PROVIDER=efa, GPUDirect RDMA) carries {carried}")
        if nodes > 1 and plan.engine == "vllm" and target == "kserve":
            lines.append(f"- port {RAY_PORT} on the head: Ray's GCS, which the workers join (HEAD_SVC); KServe "
                         f"starts {d.pipeline_parallel_degree - 1} worker(s) of {plan.tensor_parallel_degree} GPUs "
                         "beside the head (workerSpec: PP nodes of TP GPUs); a node Ray declares dead stops the "
                         "head's serving (exit 1), and a worker whose head is gone exits 1")
        elif nodes > 1 and plan.engine == "vllm":
            lines.append(f"- ports {VLLM_MASTER_PORT} and {LIFELINE_PORT} on the leader: vLLM's multi-node "
                         "torch.distributed master, and lmc's lifeline (a lost node stops the group, which "
                         "RecreateGroupOnPodRestart starts again)")
            if data_parallel_size(plan) > 1:
                lines.append(f"- port {VLLM_DP_RPC_PORT} on the leader: vLLM's data-parallel RPC port, where the other "
                             "instances' engines hand-shake with the leader's front end (vLLM then connects them over "
                             "ports it picks and announces there: keep the group's pods open to each other)")
    else:
        lines.append(f"- scaling target {sizing.invocations_per_instance_per_minute.value:g} invocations per "
                     f"instance per minute: {sizing.invocations_per_instance_per_minute.reason}")
    lines += [f"- predicted: TTFT {p.ttft_ms:g} ms, TPOT {p.tpot_ms:g} ms, {d.requests_per_second:g} requests/s"
              + (f", ${p.cost_per_hour:g}/h, ${p.cost_per_million_tokens:g} per million output tokens"
                 if p.cost_per_hour is not None and p.cost_per_million_tokens is not None else "")]
    missing = account.placeholders(target)
    lines += ["", "## Before you apply", ""]
    if missing:
        lines.append("These values are placeholders containing " + PLACEHOLDER + ": set them in the spec's "
                     "[deploy] section (or the flags) and run `lmc deploy` again: "
                     + ", ".join(f"`{key}`" for key in missing) + ".")
    else:
        lines.append("Every account value came from the spec or the flags.")
    data = "an S3 prefix: `lmc build SPEC --format dir`, then `aws s3 sync model/ PREFIX`"
    if account.compressed:
        data = "a model.tar.gz: `lmc build SPEC`, then `aws s3 cp model.tar.gz URI`"
    lines.append(f"The model data is {data}.")
    lines += ["", *_apply_steps(target, instances_per_copy_of(plan), d.min_instances < d.max_instances)]
    return "\n".join(lines) + "\n"


def _describe_file(path: str) -> str:
    name = path.rsplit("/", 1)[1]
    if name.endswith(".json"):
        words = name[:-5].split("-")
        return ": the request body of " + "".join(w.capitalize() for w in words)
    return {"deployment.yaml": ": a Deployment, one pod per instance",
            "leaderworkerset.yaml": ": a LeaderWorkerSet, one group of instances per model copy",
            "service.yaml": ": a Service in front of the serving pods",
            "serviceaccount.yaml": ": the ServiceAccount the pods run as (its IAM role reads the model data)",
            "inferenceservice.yaml": ": a KServe InferenceService (raw deployment)",
            "servingruntime.yaml": ": the ServingRuntime it names: the Ray head's container and the workers' "
                                   "(workerSpec)"}.get(name, "")


def _apply_steps(target: str, nodes: int, scales: bool = True) -> list[str]:
    if target == "sagemaker":
        steps = ["Apply, in this order:", "",
                 "    aws sagemaker create-model --cli-input-json file://create-model.json",
                 "    aws sagemaker create-endpoint-config --cli-input-json file://create-endpoint-config.json",
                 "    aws sagemaker create-endpoint --cli-input-json file://create-endpoint.json"]
        if scales:
            steps += ["    aws application-autoscaling register-scalable-target --cli-input-json file://register-scalable-target.json",
                      "    aws application-autoscaling put-scaling-policy --cli-input-json file://put-scaling-policy.json"]
        return steps
    if target == "kubernetes":
        steps = ["Apply with `kubectl apply -f .`; the pods need nodes of the instance type in nodeSelector, node "
                 "ephemeral storage that holds the model volume (on NVMe instances, the kubelet's root on the instance "
                 "store), and read access to the model data for the role in serviceaccount.yaml (IRSA: the cluster's "
                 "OIDC provider trusted by that role; or an EKS Pod Identity association for the service account)."]
        if nodes > 1:
            steps.append("LeaderWorkerSet must be installed (https://github.com/kubernetes-sigs/lws); each group's "
                         "pods join through LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX.")
        return steps
    if nodes > 1:
        return ["Apply with `kubectl apply -f serviceaccount.yaml -f servingruntime.yaml -f inferenceservice.yaml` on a "
                "cluster with KServe 0.15 or later (raw deployment mode, multi-node; no HPA); its storage initializer fetches storageUri into "
                "/mnt/models on the head and on every worker. The image needs lmc's `ray` extra: the head's `lmc "
                "runtime` starts Ray's head and waits for RAY_NODE_COUNT nodes, each worker's joins it through "
                "HEAD_SVC, and vLLM runs on the cluster (distributed_executor_backend = ray)."]
    return ["Apply with `kubectl apply -f serviceaccount.yaml -f inferenceservice.yaml` on a cluster with KServe 0.15 or "
            "later (raw deployment mode; autoscaler class none: no HPA, the replicas are the plan's); its storage "
            "initializer fetches STORAGE_URI into /mnt/models as the service account, whose role (IRSA) reads it."]
