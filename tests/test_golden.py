"""Golden outputs per example spec: the plan, the human report, the emitted files, the archive listing.

Like black's golden cases, every check also runs the stage twice to prove it is stable.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from golden import golden_file
from lmc.cli.main import main
from lmc.errors import NoFeasiblePlanError
from lmc.pipeline import plan_from_spec
from lmc.schema import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.toml"))
CPU_SPEC = ROOT / "specs" / "tiny-llama-cpu.toml"
# Specs whose model.path is the tiny checkpoint the tests create.
CPU_SPECS = (CPU_SPEC, ROOT / "specs" / "tiny-llama-cpu-vllm.toml")
GOLDEN = ROOT / "golden"

# syrupy warns that a golden file's name does not contain the test's name: that is the layout.
pytestmark = pytest.mark.filterwarnings("ignore:.*Can not relate snapshot")


@pytest.fixture(scope="session")
def cpu_checkpoint():
    """The CPU example's tiny random Llama, created where the spec expects it."""
    from lmc.testing.checkpoints import make_checkpoint

    target = ROOT / "specs" / "models" / "tiny-llama"
    vllm_width = ROOT / "specs" / "models" / "tiny-llama-vllm"  # heads of 32: vLLM's CPU kernels' smallest
    make_checkpoint("llama", vllm_width, seed=0, hidden_size=128, intermediate_size=256)
    return make_checkpoint("llama", target, seed=0)


def _plan_or_none(spec: Path):
    try:
        return plan_from_spec(load_spec(spec))
    except NoFeasiblePlanError:
        return None


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_golden_plan(spec: Path, snapshot, request):
    if spec in CPU_SPECS:
        request.getfixturevalue("cpu_checkpoint")
    result = _plan_or_none(spec)
    if result is None:
        err = io.StringIO()
        with redirect_stderr(err):
            code = main(["plan", str(spec)])
        assert code == 3
        assert err.getvalue() == _capture_plan_error(spec), "the infeasible verdict must be stable"
        assert err.getvalue() == snapshot(extension_class=golden_file(spec.stem, "plan.txt"))
        return
    again = plan_from_spec(load_spec(spec))
    assert result.plan.to_json() == again.plan.to_json(), "planning must be deterministic"
    assert result.plan.to_json() == snapshot(extension_class=golden_file(spec.stem, "plan.json"))

    from lmc.planner.report import render_plan

    report = render_plan(result.plan, load_spec(spec).spec, explain=True)
    assert report == snapshot(extension_class=golden_file(spec.stem, "report.txt"))


def _capture_plan_error(spec: Path) -> str:
    err = io.StringIO()
    with redirect_stderr(err):
        main(["plan", str(spec)])
    return err.getvalue()


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_golden_emitted_files(spec: Path, snapshot, request):
    if spec in CPU_SPECS:
        request.getfixturevalue("cpu_checkpoint")
    result = _plan_or_none(spec)
    if result is None:
        pytest.skip("no feasible plan: nothing is emitted (see plan.txt)")
    from lmc.emitters.render import render_text_files

    loaded = load_spec(spec)
    files = render_text_files(result.plan, loaded.spec)
    assert files == render_text_files(result.plan, loaded.spec), "rendering must be deterministic"
    assert files["serving.properties"].decode() == snapshot(
        extension_class=golden_file(spec.stem, "serving.properties"))
    if result.plan.engine == "vllm":  # LMI's vLLM handler is the entry point (render.VLLM_OMITS)
        assert "model.py" not in files
        return
    assert files["model.py"].decode() == snapshot(extension_class=golden_file(spec.stem, "model.py"))


def test_golden_cpu_archive_listing(cpu_checkpoint, tmp_path, snapshot):
    from lmc.emitters.archive import archive_listing

    out = tmp_path / "model.tar.gz"
    assert main(["build", str(CPU_SPEC), "-o", str(out)]) == 0
    listing = "".join(f"{size:>10}  {digest}  {path}\n" for path, size, digest in archive_listing(out))
    assert listing == snapshot(extension_class=golden_file(CPU_SPEC.stem, "archive.txt"))


def test_no_unused_golden_files(cpu_checkpoint):
    """Every file under golden/ belongs to a spec in specs/ and a check above: stale goldens fail."""
    expected = {f"{CPU_SPEC.stem}/archive.txt"}
    for spec in SPECS:
        result = _plan_or_none(spec)
        if result is None:
            expected.add(f"{spec.stem}/plan.txt")
        else:
            names = ("plan.json", "report.txt", "serving.properties") + (() if result.plan.engine == "vllm" else ("model.py",))
            expected.update(f"{spec.stem}/{name}" for name in names)
    present = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*") if p.is_file()
               and p.relative_to(GOLDEN).parts[1:2] != ("deploy",)}  # tests/test_deploy.py checks those
    assert present - expected == set(), "golden files no check produces: delete them (or run --snapshot-update)"
    assert expected - present == set(), "golden files missing: run `pytest --snapshot-update`"


def test_the_model_table_in_the_docs_says_what_the_golden_plans_say():
    """docs/models.md's table of current models names each one's golden spec and its plan: engine, dtype, layout
    (lmc.layouts.parallel_layout), replicas and TPOT. The column is checked against the golden plan.json, so
    a planner change that moves a golden plan moves the table too (three rows once kept TP-only layouts
    after data-parallel attention was chosen)."""
    import json

    from lmc.layouts import data_parallel_degree, parallel_layout, pipeline_degree

    lines = (ROOT / "docs" / "models.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith("| golden spec | plan |"))
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|"))
    assert len(rows) >= 12, "docs/models.md's model table not found"
    for cells in rows:
        name = cells[-3].strip().strip("`")
        plan = json.loads((GOLDEN / name / "plan.json").read_text())
        layout = parallel_layout(plan["tensor_parallel_degree"], data_parallel_degree(plan), pipeline_degree(plan))
        want = (f"{plan['engine']} {plan['dtype']} {layout} × {plan['replicas']}, "
                f"TPOT {plan['predicted']['tpot_ms']:.1f} ms")
        assert cells[-2].strip() == want, name
