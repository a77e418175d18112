"""`lmc deploy`: golden files per spec and target, validated offline against the platforms' own schemas.

SageMaker and Application Auto Scaling bodies: botocore's service model (its ParamValidator, plus what it
leaves unchecked: whole-value string patterns, enums, maximum lengths and values). Deployment and Service: the Kubernetes OpenAPI
schemas bundled in kubernetes-validate. LeaderWorkerSet and KServe InferenceService: their published
CRD schemas, kept in tests/data/crds (README there: source, tag, commit, sha256).
"""

from __future__ import annotations

import gzip
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path

import pytest

from golden import GOLDEN_DIR, golden_file
from lmc.cli.main import main
from lmc.emitters.deploy import TARGETS, Account, render_deployment, resource_name
from lmc.errors import NoFeasiblePlanError
from lmc.pipeline import plan_from_spec
from lmc.schema import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.toml"))
CPU_SPEC = ROOT / "specs" / "tiny-llama-cpu.toml"
CRDS = Path(__file__).parent / "data" / "crds"
K8S_VERSION = "1.33.0"
SAGEMAKER_OPERATIONS = {
    "create-model.json": ("sagemaker", "CreateModel"),
    "create-endpoint-config.json": ("sagemaker", "CreateEndpointConfig"),
    "create-endpoint.json": ("sagemaker", "CreateEndpoint"),
    "register-scalable-target.json": ("application-autoscaling", "RegisterScalableTarget"),
    "put-scaling-policy.json": ("application-autoscaling", "PutScalingPolicy"),
}

pytestmark = pytest.mark.filterwarnings("ignore:.*Can not relate snapshot")


@pytest.fixture(scope="module", autouse=True)
def _spec_checkpoints(cpu_checkpoint):
    """The CPU specs' checkpoints (conftest's cpu_checkpoint), before any spec is planned."""


@cache
def planned(spec: Path):
    try:
        return plan_from_spec(load_spec(spec))
    except NoFeasiblePlanError:
        return None


def refusal(spec: Path, target: str) -> str | None:
    """Why `target` cannot run the spec's plan (None: it can). The refusals are by design (docs/deploy.md)."""
    result = planned(spec)
    try:
        render_deployment(target, result.plan, result.hardware, Account(name=resource_name(spec.stem)))
    except NoFeasiblePlanError as exc:
        return str(exc)
    return None


def deploy_files(spec: Path, target: str) -> dict[str, bytes]:
    result = planned(spec)
    return render_deployment(target, result.plan, result.hardware, Account(name=resource_name(spec.stem)))


CASES = [(spec, target) for spec in SPECS for target in TARGETS]


# --- validators ----------------------------------------------------------------------------------------

@cache
def _service_model(service: str):
    import botocore.session

    return botocore.session.get_session().get_service_model(service)


def _shape_errors(shape, value, where: str) -> list[str]:
    """What botocore's ParamValidator leaves out, recursively: string patterns (matched against the whole
    value, as the service does), enums, maximum lengths and values, and a map's bounds (it checks only
    minimums of strings, lists and numbers)."""
    errors = _bound_errors(shape, value, where)
    if shape.type_name == "structure" and isinstance(value, dict):
        for key, item in value.items():
            if key in shape.members:
                errors += _shape_errors(shape.members[key], item, f"{where}.{key}")
    elif shape.type_name == "list" and isinstance(value, list):
        for i, item in enumerate(value):
            errors += _shape_errors(shape.member, item, f"{where}[{i}]")
    elif shape.type_name == "map" and isinstance(value, dict):
        for key, item in value.items():
            errors += _shape_errors(shape.key, key, f"{where} key")
            errors += _shape_errors(shape.value, item, f"{where}.{key}")
    elif shape.type_name == "string" and isinstance(value, str):
        pattern = _python_pattern(shape.metadata.get("pattern"))
        if pattern is not None and not pattern.fullmatch(value):
            errors.append(f"{where} = {value!r} does not match {pattern.pattern}")
        if shape.enum and value not in shape.enum:
            errors.append(f"{where} = {value!r} is not one of the enum")
    return errors


def _bound_errors(shape, value, where: str) -> list[str]:
    """A string's or a collection's length, or a number's value, past the shape's `max` (and a map's
    length under its `min`, which ParamValidator skips)."""
    if shape.type_name in ("string", "list", "map") and isinstance(value, (str, list, dict)):
        size, what = len(value), "length"
    elif shape.type_name in ("integer", "long", "float", "double") and isinstance(value, (int, float)):
        size, what = value, "value"
    else:
        return []
    top = shape.metadata.get("max")
    if top is not None and size > top:
        return [f"{where}: {what} {size} is over the maximum {top}"]
    bottom = shape.metadata.get("min")
    if shape.type_name == "map" and bottom is not None and size < bottom:
        return [f"{where}: {what} {size} is under the minimum {bottom}"]
    return []


# Java regex syntax botocore's patterns use that Python's does not read: a UTF-16 surrogate-pair range
# (the supplementary planes) and the POSIX class \p{Print} (US-ASCII in Java). The `regex` module
# (a transformers dependency) reads the Unicode classes \p{L}, \p{Z}, \p{N}.
_JAVA_SYNTAX = {r"\uD800\uDC00-\uDBFF\uDFFF": r"\U00010000-\U0010FFFF", r"\p{Print}": r"[\x20-\x7E]"}


@cache
def _python_pattern(pattern: str | None):
    """botocore's pattern as a compiled regex (the `regex` module's, which reads the Unicode classes)."""
    if not pattern:
        return None
    import regex

    for java, python in _JAVA_SYNTAX.items():
        pattern = pattern.replace(java, python)
    return regex.compile(pattern)


def validate_aws(file: str, body: dict) -> list[str]:
    from botocore.validate import ParamValidator

    service, operation = SAGEMAKER_OPERATIONS[file]
    shape = _service_model(service).operation_model(operation).input_shape
    report = ParamValidator().validate(body, shape)
    errors = [report.generate_report()] if report.has_errors() else []
    return errors + _shape_errors(shape, body, operation)


@cache
def _crd_schema(filename: str, kind: str) -> dict:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(gzip.decompress((CRDS / filename).read_bytes()), Loader=loader)
    assert crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]


CRD_FILES = {"LeaderWorkerSet": "leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz",
             "InferenceService": "serving.kserve.io_inferenceservices.yaml.gz",
             "ServingRuntime": "serving.kserve.io_servingruntimes.yaml.gz"}


def validate_manifest(document: dict) -> list[str]:
    kind = document["kind"]
    if kind in CRD_FILES:
        import jsonschema

        schema = _crd_schema(CRD_FILES[kind], kind)
        validator = jsonschema.Draft7Validator(schema)
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
        return errors + _unknown_fields(schema, document, kind)
    import kubernetes_validate

    try:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{kind}: {exc.message} at {'/'.join(map(str, exc.path))}"]
    return []


def _unknown_fields(schema: dict, value, where: str) -> list[str]:
    """CRD schemas rarely say additionalProperties: false; the API server prunes unknown fields
    silently, so a typo would vanish. Check every key is one the schema knows."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(value, (dict, list)):
        return []
    if isinstance(value, list):
        return [e for i, item in enumerate(value) for e in _unknown_fields(schema.get("items", {}), item, f"{where}[{i}]")]
    properties = schema.get("properties")
    if properties is None:
        extra = schema.get("additionalProperties")
        return [e for k, v in value.items() for e in _unknown_fields(extra, v, f"{where}.{k}")] if isinstance(extra, dict) else []
    errors = []
    for key, item in value.items():
        if key not in properties:
            if where.count(".") <= 0 and key in ("apiVersion", "kind", "metadata"):
                continue
            errors.append(f"{where}.{key}: not in the schema")
        else:
            errors += _unknown_fields(properties[key], item, f"{where}.{key}")
    return errors


def documents(text: str) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(text) if d is not None]


# --- goldens and validity, per spec and target ---------------------------------------------------------

@pytest.mark.parametrize(("spec", "target"), CASES, ids=[f"{s.stem}-{t}" for s, t in CASES])
def test_deploy_files_are_golden_and_valid(spec: Path, target: str, snapshot):
    if planned(spec) is None:
        pytest.skip("no feasible plan (see plan.txt)")
    why = refusal(spec, target)
    if why is not None:
        pytest.skip(f"refused by design: {why}")
    files = deploy_files(spec, target)
    assert files == deploy_files(spec, target), "rendering must be deterministic"
    errors = []
    for path, body in files.items():
        text = body.decode()
        assert text == snapshot(extension_class=golden_file(f"{spec.stem}/deploy/{target}", path.split("/", 1)[1]))
        if path.endswith(".json"):
            errors += [f"{path}: {e}" for e in validate_aws(path.split("/", 1)[1], json.loads(text))]
        elif path.endswith(".yaml"):
            for document in documents(text):
                errors += [f"{path}: {e}" for e in validate_manifest(document)]
    assert errors == []


def test_only_the_documented_refusals():
    """Every plannable spec deploys to every target, except a copy across instances on SageMaker (and on
    KServe unless it is one vLLM copy of pipeline stages on GPUs: not data-parallel groups across instances),
    and the local CPU on SageMaker (which has no such instance type)."""
    refused = {(s.stem, t): refusal(s, t) for s, t in CASES if planned(s) is not None and refusal(s, t) is not None}
    expected = set()
    for spec in SPECS:
        result = planned(spec)
        if result is None:
            continue
        d, vllm = result.plan.deployment, result.plan.vllm
        dp = vllm.data_parallel_size if vllm is not None else 1
        nodes = d.pipeline_parallel_degree * max(result.plan.tensor_parallel_degree * dp // result.plan.target.devices, 1)
        if nodes > 1:
            expected.add((spec.stem, "sagemaker"))
            if d.instances > nodes or dp > 1:
                expected.add((spec.stem, "kserve"))
        if not result.plan.target.instance.startswith("ml."):
            expected.add((spec.stem, "sagemaker"))
    assert set(refused) == expected
    assert ("llama-3-1-405b-p4d-24xlarge", "kubernetes") not in refused and ("tiny-llama-cpu", "sagemaker") in refused
    assert ("llama-3-1-405b-p4d-24xlarge", "kserve") not in refused  # KServe's multi-node InferenceService, on Ray
    assert "(TP 8 × PP 4) on 4 instances" in refused[("llama-3-1-405b-p4d-24xlarge", "sagemaker")]
    assert ("deepseek-v3-wide-ep-2x-p5-48xlarge", "kubernetes") not in refused
    assert "spreads data-parallel groups over 2 instances" in refused[("deepseek-v3-wide-ep-2x-p5-48xlarge", "kserve")]
    assert "an endpoint needs an ml.* instance type" in refused[("tiny-llama-cpu", "sagemaker")]


def _with_deployment(plan, **changes):
    return plan.model_copy(update={"deployment": plan.deployment.model_copy(update=changes)})


def test_kserve_refuses_several_copies_and_cpus_across_instances():
    result = planned(ROOT / "specs" / "llama-3-1-405b-p4d-24xlarge.toml")
    hardware, account = result.hardware, Account(name="llama")
    with pytest.raises(NoFeasiblePlanError, match="one Ray cluster serving one model copy, and the plan runs 2 copies "
                                                  "of 4 instances"):
        render_deployment("kserve", _with_deployment(result.plan, instances=8), hardware, account)
    cpu = planned(ROOT / "specs" / "tiny-llama-cpu-vllm.toml").hardware
    with pytest.raises(NoFeasiblePlanError, match="vLLM's cpu platform does not run on Ray"):
        render_deployment("kserve", result.plan, cpu, account)


def test_the_kserve_multi_node_files_place_each_lmc_runtime_on_ray():
    """The ServingRuntime's head and worker containers, with the variables KServe's controller adds
    (pkg/controller/v1beta1/inferenceservice/components/predictor.go: RAY_NODE_COUNT, HEAD_SVC), give each
    `lmc runtime` its place on the Ray cluster: the head waits for PP nodes, a worker joins the head's Service."""
    from lmc.runtime.vllm_ray import resolve_ray_place

    for stem, pp in (("llama-3-1-405b-p4d-24xlarge", 4), ("deepseek-v3-2x-p5-48xlarge", 2)):
        plan = planned(ROOT / "specs" / f"{stem}.toml").plan
        files = deploy_files(ROOT / "specs" / f"{stem}.toml", "kserve")
        assert set(files) == {"kserve/servingruntime.yaml", "kserve/inferenceservice.yaml", "kserve/serviceaccount.yaml",
                              "kserve/README.md"}
        runtime = documents(files["kserve/servingruntime.yaml"].decode())[0]
        isvc = documents(files["kserve/inferenceservice.yaml"].decode())[0]
        predictor = isvc["spec"]["predictor"]
        assert predictor["model"]["runtime"] == runtime["metadata"]["name"]
        assert predictor["model"]["modelFormat"]["name"] == runtime["spec"]["supportedModelFormats"][0]["name"]
        workers = runtime["spec"]["workerSpec"]
        assert (workers["pipelineParallelSize"], workers["tensorParallelSize"]) == (pp, plan.tensor_parallel_degree)
        assert (predictor["workerSpec"]["pipelineParallelSize"], predictor["workerSpec"]["tensorParallelSize"]) == (
            pp, plan.tensor_parallel_degree)
        head, worker = runtime["spec"]["containers"][0], workers["containers"][0]
        assert (head["name"], worker["name"]) == ("kserve-container", "worker-container")
        # KServe's Ray mode: nodes = TP·PP / the worker's GPUs, so each pod asks for TP GPUs
        assert head["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == str(
            plan.tensor_parallel_degree)
        assert 6379 in {port["containerPort"] for port in head["ports"]} and "ports" not in worker

        def environment(container, **injected):
            env = {e["name"]: e.get("value") for e in container["env"]}
            env.update(POD_IP="10.0.3.7", POD_NAMESPACE="serving")  # the fieldRefs, as the kubelet fills them
            return {**env, **injected}

        head_place = resolve_ray_place(plan.model_dump(mode="json"), environment(head, RAY_NODE_COUNT=str(pp)))
        assert (head_place.role, head_place.address, head_place.nodes) == ("head", "10.0.3.7:6379", pp)
        worker_place = resolve_ray_place(plan.model_dump(mode="json"), environment(
            worker, RAY_NODE_COUNT=str(pp), HEAD_SVC=f"{stem}-head-1"))
        assert (worker_place.role, worker_place.address) == ("worker", f"{stem}-head-1.serving.svc.cluster.local:6379")


def test_no_unused_deploy_goldens():
    expected = set()
    for spec, target in CASES:
        if planned(spec) is not None and refusal(spec, target) is None:
            expected |= {f"{spec.stem}/deploy/{path}" for path in deploy_files(spec, target)}
    present = {str(p.relative_to(GOLDEN_DIR)) for p in GOLDEN_DIR.glob("*/deploy/**/*") if p.is_file()}
    assert present - expected == set(), "deploy goldens no check produces: delete them"
    assert expected - present == set(), "deploy goldens missing: run `pytest --snapshot-update`"


# --- what the numbers must guarantee -------------------------------------------------------------------

BLOOM = ROOT / "specs" / "bloom-176b-p4d-24xlarge.toml"


def test_bloom_timeouts_outlast_the_load_and_the_storage_holds_the_artifact():
    result = planned(BLOOM)
    load = result.plan.predicted.load_seconds
    config = json.loads((GOLDEN_DIR / BLOOM.stem / "deploy/sagemaker/create-endpoint-config.json").read_text())
    variant = config["ProductionVariants"][0]
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] > load
    assert variant["ModelDataDownloadTimeoutInSeconds"] > load
    model = json.loads((GOLDEN_DIR / BLOOM.stem / "deploy/sagemaker/create-model.json").read_text())
    server_timeout = int(model["PrimaryContainer"]["Environment"]["OPTION_MODEL_LOADING_TIMEOUT"])
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] > server_timeout > load
    artifact = result.plan.memory_per_device.weights * result.plan.tensor_parallel_degree
    assert artifact > 200e9  # the int8 BLOOM-176B: the figure is the real size, not a stub
    # p4d has NVMe instance storage (SageMaker takes no EBS volume there): it must hold the artifact.
    assert "VolumeSizeInGB" not in variant
    assert result.hardware.instance_storage_bytes >= artifact
    # Kubernetes: the model volume and the startup probe.
    deployment = documents((GOLDEN_DIR / BLOOM.stem / "deploy/kubernetes/deployment.yaml").read_text())[0]
    pod = deployment["spec"]["template"]["spec"]
    model_volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert _gib(model_volume["emptyDir"]["sizeLimit"]) >= artifact
    probe = pod["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] > server_timeout


def _gib(quantity: str) -> int:
    assert quantity.endswith("Gi")
    return int(quantity[:-2]) * 2**30


def test_sagemaker_hosts_exactly_the_catalog_instances_its_service_model_lists(tmp_path):
    """The catalog's `sagemaker_hosting` flag is botocore's list of endpoint instance types (CreateEndpointConfig's
    ProductionVariantInstanceType), and a plan on a type SageMaker does not host (p3dn, a training type) is refused
    for SageMaker with the reason, and deploys to Kubernetes; its files would otherwise fail that list."""
    from lmc.planner import catalog

    hosted = set(_service_model("sagemaker").shape_for("ProductionVariantInstanceType").enum)
    flags = {name: catalog.hardware_facts(name).sagemaker_hosting for name in catalog.list_instances()}
    assert {name for name, flag in flags.items() if flag != (name in hosted)} == set()
    assert flags["ml.p3dn.24xlarge"] is False and flags["ml.p3.16xlarge"] is True
    spec = tmp_path / "p3dn.toml"
    spec.write_text('[model]\nid = "bigscience/bloom-7b1"\n[target]\ninstance = "ml.p3dn.24xlarge"\n'
                    "[workload]\nmax_input_tokens = 512\nmax_output_tokens = 128\nconcurrency = 1\n")
    result = plan_from_spec(load_spec(spec))
    with pytest.raises(NoFeasiblePlanError, match="ml.p3dn.24xlarge is a training instance type"):
        render_deployment("sagemaker", result.plan, result.hardware, Account(name="p3dn"))
    files = render_deployment("kubernetes", result.plan, result.hardware, Account(name="p3dn"))
    assert [e for path, body in files.items() if path.endswith(".yaml")
            for document in documents(body.decode()) for e in validate_manifest(document)] == []
    code, _, err = _run(["deploy", "--target", "sagemaker", "-o", str(tmp_path / "out"), str(spec)])
    assert code == 3 and "does not offer for endpoints" in err and not (tmp_path / "out" / "sagemaker").exists()


@pytest.mark.parametrize("stem", ["gpt4all-j-inf2-8xlarge", "gpt-j-6b-deepspeed-p3-2xlarge"])
def test_ebs_volume_holds_the_artifact_where_the_instance_has_no_nvme(stem):
    result = planned(ROOT / "specs" / f"{stem}.toml")
    assert result.hardware.instance_storage_bytes is None
    variant = json.loads(deploy_files(ROOT / "specs" / f"{stem}.toml", "sagemaker")
                         ["sagemaker/create-endpoint-config.json"])["ProductionVariants"][0]
    artifact = result.plan.memory_per_device.weights * result.plan.tensor_parallel_degree
    assert variant["VolumeSizeInGB"] * 1e9 >= artifact * 1.1


def test_405b_runs_as_a_leaderworkerset_of_its_stages():
    spec = ROOT / "specs" / "llama-3-1-405b-p4d-24xlarge.toml"
    plan = planned(spec).plan
    assert plan.deployment.pipeline_parallel_degree >= 2
    lws = documents(deploy_files(spec, "kubernetes")["kubernetes/leaderworkerset.yaml"].decode())[0]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == plan.deployment.pipeline_parallel_degree
    assert lws["spec"]["replicas"] * plan.deployment.pipeline_parallel_degree == plan.deployment.instances
    service = documents(deploy_files(spec, "kubernetes")["kubernetes/service.yaml"].decode())[0]
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8" and "readinessProbe" in leader
    assert "readinessProbe" not in worker
    # vLLM's multi-node mode (issue 23): its master and lmc's lifeline on the leader; EFA on every pod
    assert plan.engine == "vllm"
    assert {port["containerPort"] for port in leader["ports"]} == {8080, 29501, 29510}
    for pod in (leader, worker):
        assert pod["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"  # p4d: 4 × 100 Gbps
        assert {"name": "FI_PROVIDER", "value": "efa"} in pod["env"]
    deepseek = documents(deploy_files(ROOT / "specs" / "deepseek-v3-2x-p5-48xlarge.toml", "kubernetes")
                         ["kubernetes/leaderworkerset.yaml"].decode())[0]
    assert deepseek["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert deepseek["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    worker = deepseek["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"  # p5: 32 × 100 Gbps


def test_a_validator_catches_a_wrong_body():
    """The validators are not vacuous: a misspelt field, a wrong type and a bad enum are reported."""
    body = json.loads(deploy_files(BLOOM, "sagemaker")["sagemaker/create-endpoint-config.json"])
    body["ProductionVariants"][0]["InitialInstanceCount"] = "1"
    body["ProductionVariants"][0]["InstanceType"] = "ml.p4d.25xlarge"
    assert len(validate_aws("create-endpoint-config.json", body)) == 2
    deployment = documents(deploy_files(BLOOM, "kubernetes")["kubernetes/deployment.yaml"].decode())[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["startupprobe"] = {}
    assert validate_manifest(deployment) != []
    lws = documents(deploy_files(ROOT / "specs" / "llama-3-1-405b-p4d-24xlarge.toml", "kubernetes")
                    ["kubernetes/leaderworkerset.yaml"].decode())[0]
    lws["spec"]["leaderWorkerTemplate"]["size"] = "4"
    assert validate_manifest(lws) != []
    isvc = documents(deploy_files(BLOOM, "kserve")["kserve/inferenceservice.yaml"].decode())[0]
    isvc["spec"]["predictor"]["minReplica"] = 1
    assert validate_manifest(isvc) == ["InferenceService.spec.predictor.minReplica: not in the schema"]


@pytest.mark.parametrize(("file", "path", "value", "error"), [
    # botocore's patterns are unanchored: each of these names has a valid run of characters inside it
    ("create-endpoint.json", ("EndpointName",), "bad_name!! with spaces", "CreateEndpoint.EndpointName = 'bad_name!! with spaces' does not match"),
    ("create-model.json", ("ModelName",), "a" * 200, "CreateModel.ModelName: length 200 is over the maximum 63"),
    ("create-model.json", ("ModelName",), "Llama_2.7b", "CreateModel.ModelName = 'Llama_2.7b' does not match"),
    ("create-model.json", ("PrimaryContainer", "Environment", "BAD-KEY.X"), "1",
     "CreateModel.PrimaryContainer.Environment key = 'BAD-KEY.X' does not match"),
    ("create-model.json", ("PrimaryContainer", "ModelDataSource", "S3DataSource", "CompressionType"), "Zip",
     "CreateModel.PrimaryContainer.ModelDataSource.S3DataSource.CompressionType = 'Zip' is not one of the enum"),
    ("create-endpoint-config.json", ("ProductionVariants", 0, "ModelDataDownloadTimeoutInSeconds"), 7200,
     "CreateEndpointConfig.ProductionVariants[0].ModelDataDownloadTimeoutInSeconds: value 7200 is over the maximum 3600"),
    ("put-scaling-policy.json", ("PolicyName",), "policy\u00e9", "PutScalingPolicy.PolicyName = 'policy\u00e9' does not match"),
])
def test_the_aws_validator_catches_a_wrong_name_length_enum_or_bound(file, path, value, error):
    """Each field alone made wrong in a body that validates: exactly one error, the one expected. The
    patterns are matched against the whole value (a name with one valid character does not pass),
    maximum lengths and values are checked, and the Java-only classes (\\p{Print}) are read."""
    body = json.loads(deploy_files(ROOT / "specs" / "llama-3-1-8b-g5-2xlarge-autoscaling.toml", "sagemaker")[f"sagemaker/{file}"])
    assert validate_aws(file, body) == []
    *parents, last = path
    target = body
    for key in parents:
        target = target[key]
    target[last] = value
    errors = validate_aws(file, body)
    assert len(errors) == 1 and errors[0].startswith(error), errors


# --- the CLI -----------------------------------------------------------------------------------------

def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_writes_the_files_and_names_the_placeholders(tmp_path):
    code, out, err = _run(["deploy", str(BLOOM), "--target", "sagemaker", "-o", str(tmp_path)])
    assert code == 0
    written = sorted(p.name for p in (tmp_path / "sagemaker").iterdir())
    # the plan's autoscaling bounds are equal (1-1): nothing to scale, so no scaling target or policy
    assert written == ["README.md", "create-endpoint-config.json", "create-endpoint.json", "create-model.json"]
    assert "image ([deploy] image or --image), role_arn ([deploy] role_arn or --role), model_data" in err
    assert "REPLACE_ME" in (tmp_path / "sagemaker" / "create-model.json").read_text()
    code, out, err = _run(["deploy", str(BLOOM), "--target", "sagemaker", "-o", str(tmp_path),
                           "--image", "123456789012.dkr.ecr.us-east-1.amazonaws.com/lmc:1",
                           "--role", "arn:aws:iam::123456789012:role/sm", "--model-data", "s3://b/bloom/model.tar.gz"])
    assert (code, err) == (0, "")
    texts = [p.read_text() for p in (tmp_path / "sagemaker").iterdir()]
    assert not any("REPLACE_ME" in t for t in texts)
    model = json.loads((tmp_path / "sagemaker" / "create-model.json").read_text())
    assert model["PrimaryContainer"]["ModelDataUrl"] == "s3://b/bloom/model.tar.gz"
    assert validate_aws("create-model.json", model) == []


def test_cli_refuses_a_bad_role_and_a_foreign_directory(tmp_path):
    code, _, err = _run(["deploy", str(BLOOM), "--target", "sagemaker", "-o", str(tmp_path), "--role", "arn:aws:iam::role/admin-no-account"])
    assert code == 2 and err.startswith("lmc: error: --role: String should match pattern")
    # An image reference with a space: CreateModel's ContainerImage pattern ([\S]+) refuses it, as Docker does;
    # it was written into the files (found by fuzzing the deploy flags against botocore's service model).
    code, _, err = _run(["deploy", str(BLOOM), "--target", "sagemaker", "-o", str(tmp_path), "--image", "lmc runtime"])
    assert code == 2 and err.startswith("lmc: error: --image: String should match pattern") and err.count("\n") == 1
    assert not (tmp_path / "sagemaker").exists()
    (tmp_path / "kserve").mkdir()
    (tmp_path / "kserve" / "notes.txt").write_text("mine")
    code, _, err = _run(["deploy", str(BLOOM), "--target", "kserve", "-o", str(tmp_path)])
    assert code == 2 and "holds files lmc deploy did not write" in err
    assert (tmp_path / "kserve" / "notes.txt").read_text() == "mine"


def test_cli_impossible_rate_exits_3_with_the_reason(tmp_path):
    spec = tmp_path / "rate.toml"
    spec.write_text('[model]\nid = "meta-llama/Llama-3.1-8B"\n[target]\ninstance = "ml.g5.12xlarge"\ninstances = 3\n'
                    '[workload]\nconcurrency = 4\nrequests_per_second = 200\n')
    code, _, err = _run(["deploy", str(spec), "--target", "sagemaker", "-o", str(tmp_path / "out")])
    assert code == 3
    first = err.splitlines()[0]
    assert first.startswith("lmc: no feasible plan: requests_per_second = 200 needs ")
    assert first.endswith("target.instances = 3 allows 3")
    assert not (tmp_path / "out").exists()


def test_cli_pipeline_plan_on_sagemaker_exits_3(tmp_path):
    spec = ROOT / "specs" / "llama-3-1-405b-p4d-24xlarge.toml"
    code, _, err = _run(["deploy", str(spec), "--target", "sagemaker", "-o", str(tmp_path)])
    assert code == 3
    assert "use --target kubernetes (a LeaderWorkerSet of each copy's instances)" in err


def test_crd_files_are_the_upstream_bytes_listed_in_their_readme():
    import hashlib

    rows = [line.split("|") for line in (CRDS / "README.md").read_text().splitlines() if line.startswith("| ") and ".gz" in line]
    assert {row[1].strip() for row in rows} == set(CRD_FILES.values())
    for row in rows:
        digest = hashlib.sha256(gzip.decompress((CRDS / row[1].strip()).read_bytes())).hexdigest()
        assert digest == row[5].strip()


def test_cli_takes_the_account_values_from_the_spec(tmp_path):
    spec = tmp_path / "mine.toml"
    spec.write_text(BLOOM.read_text() + '\n[deploy]\nname = "bloom-prod"\n'
                    'image = "123456789012.dkr.ecr.us-west-2.amazonaws.com/lmc:0.1.0"\n'
                    'role_arn = "arn:aws:iam::123456789012:role/sagemaker"\nmodel_data = "s3://models/bloom/"\n')
    code, _, err = _run(["deploy", str(spec), "--target", "kubernetes", "-o", str(tmp_path / "out")])
    assert (code, err) == (0, "")
    deployment = documents((tmp_path / "out" / "kubernetes" / "deployment.yaml").read_text())[0]
    assert deployment["metadata"]["name"] == "bloom-prod"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "123456789012.dkr.ecr.us-west-2.amazonaws.com/lmc:0.1.0"
    assert pod["initContainers"][0]["command"][-1] == "aws s3 sync 's3://models/bloom/' '/opt/ml/model'"
    assert validate_manifest(deployment) == []


# --- sized from what `lmc build` packs (issue 32) ------------------------------------------------------

QWEN3_FP8 = ROOT / "specs" / "qwen3-8b-g5-2xlarge.toml"
AUTOSCALING = ROOT / "specs" / "llama-3-1-8b-g5-2xlarge-autoscaling.toml"


def test_a_vllm_fp8_plan_is_sized_for_the_16_bit_checkpoint_a_build_without_its_gpus_packs():
    plan = planned(QWEN3_FP8).plan
    assert (plan.engine, plan.dtype) == ("vllm", "fp8")
    config = json.loads((GOLDEN_DIR / QWEN3_FP8.stem / "deploy/sagemaker/create-endpoint-config.json").read_text())
    readme = (GOLDEN_DIR / QWEN3_FP8.stem / "deploy/kubernetes/README.md").read_text()
    bf16 = plan.model.parameters * 2
    assert f"artifact {bf16 / 1e9:.1f} GB: the checkpoint in bf16" in readme
    deployment = documents((GOLDEN_DIR / QWEN3_FP8.stem / "deploy/kubernetes/deployment.yaml").read_text())[0]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert int(volume["emptyDir"]["sizeLimit"].removesuffix("Gi")) * 2**30 >= bf16 * 1.1
    assert "VolumeSizeInGB" not in config["ProductionVariants"][0]  # g5's NVMe


def _tiny_fp8_spec(tmp_path: Path) -> Path:
    from lmc.testing.checkpoints import make_checkpoint

    make_checkpoint("qwen3", tmp_path / "qwen3", seed=0)
    spec = tmp_path / "tiny-qwen3-fp8.toml"
    spec.write_text('[model]\nid = "lmc/tiny-qwen3"\npath = "qwen3"\n[target]\ninstance = "ml.g6e.xlarge"\n'
                    '[workload]\nmax_input_tokens = 64\nmax_output_tokens = 32\nconcurrency = 2\n'
                    '[pin]\nengine = "vllm"\ndtype = "fp8"\n')
    return spec


def test_the_prediction_covers_what_a_build_host_without_gpus_packs_and_the_manifest_sizes_it(tmp_path):
    """The issue's case: a tiny qwen3 planned in fp8 for an L40S, built here (no CUDA GPU: the checkpoint in
    bf16). The prediction holds the packed weights; `--artifact` sizes from the manifest exactly."""
    from lmc.emitters.deploy import predicted_artifact, read_built_artifact
    from lmc.planner.sizing import planned_artifact

    spec = _tiny_fp8_spec(tmp_path)
    code, _, err = _run(["build", str(spec), "--format", "dir", "-o", str(tmp_path / "model")])
    assert code == 0, err
    plan = plan_from_spec(load_spec(spec)).plan
    packed = (tmp_path / "model" / "model.safetensors").stat().st_size
    assert planned_artifact(plan).value < packed  # the planned dtype's bytes would not hold it
    predicted = predicted_artifact(plan)
    assert predicted.value <= packed < predicted.value * 1.01  # the bf16 weights and their header
    built = read_built_artifact(str(tmp_path / "model"))
    assert built.plan_sha256 == plan.plan_sha256
    assert built.tree_bytes == sum(p.stat().st_size for p in (tmp_path / "model").rglob("*") if p.is_file())
    code, _, err = _run(["deploy", str(spec), "--target", "kubernetes", "-o", str(tmp_path / "out"),
                         "--artifact", str(tmp_path / "model")])
    assert code == 0, err
    readme = (tmp_path / "out" / "kubernetes" / "README.md").read_text()
    assert f"artifact {built.tree_bytes / 1e9:.1f} GB: the files {tmp_path / 'model'}'s manifest (lmc.json) lists" in readme


def test_an_artifact_from_another_plan_or_no_artifact_is_refused_in_one_line(tmp_path):
    spec = _tiny_fp8_spec(tmp_path)
    code, _, err = _run(["build", str(spec), "-o", str(tmp_path / "model.tar.gz")])
    assert code == 0, err
    other = tmp_path / "other.toml"
    other.write_text(spec.read_text().replace("concurrency = 2", "concurrency = 3"))
    code, _, err = _run(["deploy", str(other), "--target", "sagemaker", "-o", str(tmp_path / "out"),
                         "--artifact", str(tmp_path / "model.tar.gz")])
    assert code == 1 and len(err.splitlines()) == 1 and "not this spec's plan" in err, err
    (tmp_path / "junk.tar.gz").write_bytes(b"not gzip")
    code, _, err = _run(["deploy", str(spec), "--target", "sagemaker", "-o", str(tmp_path / "out"),
                         "--artifact", str(tmp_path / "junk.tar.gz")])
    assert code == 1 and "not a readable artifact" in err, err
    code, _, err = _run(["deploy", str(spec), "--target", "sagemaker", "-o", str(tmp_path / "out"),
                         "--model-data", "s3://b/m/model.tar.gz", "--artifact", str(tmp_path / "model.tar.gz")])
    assert code == 0, err
    readme = (tmp_path / "out" / "sagemaker" / "README.md").read_text()
    archive = (tmp_path / "model.tar.gz").stat().st_size
    assert f"artifact {archive / 1e9:.1f} GB: {tmp_path / 'model.tar.gz'} as built" in readme
    assert "+ its extracted tree" in readme


def test_pods_run_as_a_service_account_with_pinned_images_and_host_requests():
    files = deploy_files(QWEN3_FP8, "kubernetes")
    account = documents(files["kubernetes/serviceaccount.yaml"].decode())[0]
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::000000000000:role/REPLACE_ME")
    pod = documents(files["kubernetes/deployment.yaml"].decode())[0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] == "qwen3-8b-g5-2xlarge"
    images = [c["image"] for c in pod["initContainers"] + pod["containers"]]
    assert all(":" in image and not image.endswith(":latest") for image in images), images
    requests = pod["containers"][0]["resources"]["requests"]
    # g5.2xlarge: 8 vCPUs, 32 GiB; 10 % for DaemonSets, the EKS AMI's kube-reserved 90m / 1465 MiB, eviction 100 MiB
    assert requests["cpu"] == "7100m"
    assert requests["memory"] == f"{int((32 * 2**30 * 0.9 - (255 + 11 * 110 + 100) * 2**20) // 2**30)}Gi" == "27Gi"


def test_rollouts_surge_only_where_the_plan_leaves_an_instance_spare():
    single = documents(deploy_files(QWEN3_FP8, "kubernetes")["kubernetes/deployment.yaml"].decode())[0]
    assert single["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    text = deploy_files(QWEN3_FP8, "kubernetes")["kubernetes/deployment.yaml"].decode()
    assert text.startswith("# rollout: the plan's 1 instance(s) are all its peak needs") and \
        "down while the new one loads" in text
    plan = planned(AUTOSCALING).plan
    assert plan.deployment.instances < plan.deployment.max_instances
    scaled = documents(deploy_files(AUTOSCALING, "kubernetes")["kubernetes/deployment.yaml"].decode())[0]
    assert scaled["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}


def test_scaling_files_only_where_the_bounds_differ():
    assert "sagemaker/put-scaling-policy.json" not in deploy_files(QWEN3_FP8, "sagemaker")
    files = deploy_files(AUTOSCALING, "sagemaker")
    target = json.loads(files["sagemaker/register-scalable-target.json"])
    assert target["MinCapacity"] < target["MaxCapacity"]
    assert "sagemaker/put-scaling-policy.json" in files
    for spec in (QWEN3_FP8, AUTOSCALING):  # KServe's replicas are fixed at the plan's instances: no HPA either
        isvc = documents(deploy_files(spec, "kserve")["kserve/inferenceservice.yaml"].decode())[0]
        assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "none"
        assert isvc["spec"]["predictor"]["minReplicas"] == isvc["spec"]["predictor"]["maxReplicas"]
