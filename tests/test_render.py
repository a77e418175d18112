"""The rendered text files: serving.properties keys and values, model.py, requirements.txt."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from lmc import __version__
from lmc.emitters import render
from lmc.emitters.render import loading_timeout_seconds, render_text_files
from lmc.errors import InternalError
from lmc.planner.plan import Deployment, MemoryPerDevice, Plan, PlanModel, PlanTarget, Predicted
from lmc.schema import Spec


def make_plan(**overrides) -> Plan:
    fields = dict(
        lmc_version=__version__,
        spec_sha256="a" * 64,
        model=PlanModel(id="EleutherAI/gpt-j-6b", family="gptj", parameters=6_053_381_344, layers=28,
                        hidden_size=4096, attention_heads=16, kv_heads=16, vocab_size=50400),
        target=PlanTarget(instance="ml.g5.12xlarge", accelerator="a10g", devices=4,
                          device_memory_bytes=24 * 2**30, instances=1, price_per_hour=7.09),
        engine="deepspeed", dtype="fp16", quantization=None,
        tensor_parallel_degree=2, replicas=2, batch_size=4, max_batch_delay_ms=50, job_queue_size=100,
        max_sequence_length=1280,
        deployment=Deployment(instances=1, pipeline_parallel_degree=1, min_instances=1, max_instances=1),
        memory_per_device=MemoryPerDevice(weights=1, kv_cache=1, activations=1, runtime_overhead=1,
                                          total=4, capacity=10, headroom=6),
        predicted=Predicted(ttft_ms=100.0, tpot_ms=20.0, throughput_tokens_per_s=200.0, load_seconds=30.0,
                            cost_per_hour=7.09, cost_per_million_tokens=9.8),
        goal_met=True, decisions=[], alternatives=[],
    )
    fields.update(overrides)
    return Plan(**fields).with_digest()


def make_spec(**model) -> Spec:
    return Spec.model_validate({"model": {"id": "EleutherAI/gpt-j-6b", **model},
                                "target": {"instance": "ml.g5.12xlarge"}})


def properties(text: bytes) -> dict[str, str]:
    """Parse key=value lines (comments skipped); duplicate keys are an error."""
    out: dict[str, str] = {}
    for line in text.decode().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        assert key not in out, f"duplicate key {key}"
        out[key] = value
    return out


def llama_neuron_plan(**overrides) -> Plan:
    fields = dict(
        model=PlanModel(id="meta-llama/Llama-2-7b-hf", family="llama", parameters=6_738_415_616, layers=32,
                        hidden_size=4096, attention_heads=32, kv_heads=32, vocab_size=32000),
        target=PlanTarget(instance="ml.inf2.24xlarge", accelerator="inferentia2", devices=12,
                          device_memory_bytes=16 * 2**30, instances=1, price_per_hour=7.79),
        engine="neuronx", dtype="bf16", tensor_parallel_degree=8, replicas=1, max_sequence_length=2048)
    fields.update(overrides)
    return make_plan(**fields)


def test_deepspeed_tp2_serving_properties():
    files = render_text_files(make_plan(), make_spec(path="models/gpt-j-6b"))
    assert set(files) == {"serving.properties", "model.py", "requirements.txt"}
    props = properties(files["serving.properties"])
    assert props["engine"] == "MPI"
    assert props["option.entryPoint"] == "model.py"
    assert props["option.tensor_parallel_degree"] == "2"
    assert props["option.dtype"] == "fp16"
    assert props["batch_size"] == "4"
    assert props["max_batch_delay"] == "50"
    assert props["job_queue_size"] == "100"
    assert props["option.max_tokens"] == "1280"
    assert props["option.rolling_batch"] == "disable"
    assert props["option.trust_remote_code"] == "false"
    assert props["minWorkers"] == props["maxWorkers"] == "2"
    assert props["option.model_loading_timeout"] == "240"
    assert "option.model_id" not in props  # weights packed: served from option.model_dir
    assert "option.n_positions" not in props
    text = files["serving.properties"].decode()
    assert f"plan sha256 {make_plan().plan_sha256}" in text
    assert "spec sha256 " + "a" * 64 in text


def test_hf_engine_names_follow_the_process_model():
    one = properties(render_text_files(make_plan(engine="hf", tensor_parallel_degree=1), make_spec())["serving.properties"])
    two = properties(render_text_files(make_plan(engine="hf", tensor_parallel_degree=2), make_spec())["serving.properties"])
    assert one["engine"] == "Python"
    assert two["engine"] == "MPI"
    assert "option.max_tokens" not in one
    # MPI: every rank must get each request (the handler's ranks decode in lockstep), not rank 0 alone
    assert two["option.use_passive_workers"] == "false" and "option.use_passive_workers" not in one


def test_neuronx_plan_has_n_positions_and_compiled_graph_path():
    files = render_text_files(llama_neuron_plan(), make_spec(id="meta-llama/Llama-2-7b-hf", path="llama"))
    props = properties(files["serving.properties"])
    assert props["engine"] == "Python"
    assert props["option.n_positions"] == "2048"
    assert props["option.neuron_optimize_level"] == "2"
    assert props["option.compiled_graph_path"] == "neuron/compiled"
    assert props["option.tensor_parallel_degree"] == "8"
    assert props["option.dtype"] == "bf16"
    reqs = files["requirements.txt"].decode().splitlines()
    assert "--extra-index-url https://pip.repos.neuron.amazonaws.com" in reqs
    assert "transformers-neuronx==0.10.0.21" in reqs
    assert "neuronx-cc==2.13.66.0" in reqs
    assert "deepspeed==0.19.8" not in reqs
    assert 'DEVICE = \'neuron\'' in files["model.py"].decode()


def test_gptj_on_neuron_records_compile_at_start():
    plan = make_plan(engine="neuronx", target=PlanTarget(instance="ml.inf2.8xlarge", accelerator="inferentia2",
                                                         devices=2, device_memory_bytes=16 * 2**30, instances=1,
                                                         price_per_hour=1.97),
                     predicted=Predicted(ttft_ms=1.0, tpot_ms=1.0, throughput_tokens_per_s=1.0, load_seconds=600.0,
                                         cost_per_hour=None, cost_per_million_tokens=None))
    files = render_text_files(plan, make_spec(path="gptj"))
    props = properties(files["serving.properties"])
    assert "option.compiled_graph_path" not in props
    text = files["serving.properties"].decode()
    assert "cannot serialize compiled GPTJForSampling graphs" in text
    assert "600.0 s" in text
    assert props["option.model_loading_timeout"] == "1800"  # 3 x 600
    model_py = files["model.py"].decode()
    assert "NEURON_COMPILED_DIR = None" in model_py
    assert "compiled when the container starts" in model_py


def test_remote_uri_sets_model_id():
    files = render_text_files(make_plan(), make_spec(uri="s3://bucket/gpt-j-6b/", revision="main"))
    props = properties(files["serving.properties"])
    assert props["option.model_id"] == "s3://bucket/gpt-j-6b/"
    assert props["option.revision"] == "main"


def test_remote_uri_on_neuron_does_not_precompile():
    files = render_text_files(llama_neuron_plan(), make_spec(id="meta-llama/Llama-2-7b-hf", uri="s3://b/llama/"))
    props = properties(files["serving.properties"])
    assert "option.compiled_graph_path" not in props
    assert "the weights are remote (model.uri)" in files["serving.properties"].decode()


@pytest.mark.parametrize(("predicted", "expected"), [
    (0.0, 240), (10.0, 240), (80.0, 240), (80.5, 300), (100.0, 300), (1000.0, 3000), (1001.0, 3060),
])
def test_loading_timeout_rule(predicted, expected):
    assert loading_timeout_seconds(predicted) == expected


def test_loading_timeout_is_rendered_with_its_rule():
    plan = make_plan(predicted=Predicted(ttft_ms=1, tpot_ms=1, throughput_tokens_per_s=1, load_seconds=123.4,
                                         cost_per_hour=None, cost_per_million_tokens=None))
    text = render_text_files(plan, make_spec())["serving.properties"].decode()
    assert properties(text.encode())["option.model_loading_timeout"] == "420"  # ceil(370.2 / 60) * 60
    assert "max(240 s, 3 x the predicted load time of 123.4 s), rounded up to a whole minute" in text


def test_model_py_compiles_and_carries_the_plan_constants():
    source = render_text_files(make_plan(), make_spec())["model.py"].decode()
    tree = ast.parse(source)
    constants = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                 and node.targets[0].id.isupper()}
    assert constants == {"ENGINE": "deepspeed", "FAMILY": "gptj", "TASK": "text-generation", "DTYPE": "fp16",
                         "TENSOR_PARALLEL_DEGREE": 2, "BATCH_SIZE": 4, "MAX_SEQUENCE_LENGTH": 1280,
                         "MAX_BATCH_DELAY_MS": 50, "DEVICE": "cuda"}
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"create_engine", "handle"} <= functions
    assert "EleutherAI/gpt-j-6b" in ast.get_docstring(tree)


def test_model_py_imports_without_torch(tmp_path):
    (tmp_path / "model.py").write_bytes(render_text_files(make_plan(), make_spec())["model.py"])
    # Block torch and the engines: importing the generated module must need neither.
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'transformers', 'deepspeed'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import model
        print(model.ENGINE, model.TENSOR_PARALLEL_DEGREE, callable(model.create_engine), callable(model.handle))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "deepspeed 2 True True"


def test_create_engine_passes_the_constants(tmp_path, monkeypatch):
    (tmp_path / "model_under_test.py").write_bytes(
        render_text_files(make_plan(engine="hf", dtype="fp32", tensor_parallel_degree=2,
                                    target=PlanTarget(instance="local", accelerator="cpu", devices=1,
                                                      device_memory_bytes=2**34, instances=1, price_per_hour=None)),
                          make_spec())["model.py"])
    calls = []
    import types
    fake = types.ModuleType("lmc.runtime.engines")
    fake.create_engine = lambda engine, **kw: calls.append((engine, kw)) or "ENGINE"
    monkeypatch.setitem(sys.modules, "lmc.runtime.engines", fake)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    module = importlib.import_module("model_under_test")
    assert module.create_engine() == "ENGINE"
    assert calls == [("hf", {"family": "gptj", "task": "text-generation", "dtype": "fp32", "tensor_parallel_degree": 2,
                             "max_sequence_length": 1280, "batch_size": 4, "device": "cpu"})]
    sys.modules.pop("model_under_test", None)


def test_requirements_are_pinned_per_engine():
    deepspeed = render_text_files(make_plan(), make_spec())["requirements.txt"].decode().splitlines()
    hf = render_text_files(make_plan(engine="hf"), make_spec())["requirements.txt"].decode().splitlines()
    pins = [line for line in deepspeed if line and not line.startswith("#")]
    assert pins[0] == f"lmc=={__version__}"
    assert all("==" in line for line in pins), pins
    assert "torch==2.13.0" in pins and "transformers==5.19.0" in pins and "deepspeed==0.19.8" in pins
    assert "deepspeed==0.19.8" not in hf


def test_output_is_deterministic_and_depends_on_the_plan():
    first = render_text_files(make_plan(), make_spec())
    again = render_text_files(make_plan(), make_spec())
    assert first == again
    other = render_text_files(make_plan(batch_size=8), make_spec())
    assert other["serving.properties"] != first["serving.properties"]
    assert b"batch_size=8\n" in other["serving.properties"]


def test_a_missing_template_variable_fails(monkeypatch):
    values = render.context(make_plan(), make_spec())
    del values["batch_size"]
    with pytest.raises(InternalError, match="template serving.properties.j2: 'batch_size' is undefined"):
        render.render_template("serving.properties.j2", values)


def test_a_line_break_in_a_value_is_refused():
    with pytest.raises(Exception, match="contains a line break"):
        render_text_files(make_plan(), make_spec(uri="s3://bucket/x\nengine=Python"))
