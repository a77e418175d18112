"""Every bad spec gives exit 1 and one line naming the file, the line and the key path.

Each case is one file in tests/bad_specs/ whose first line says what the error must contain.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmc.cli.main import main

BAD_SPECS = sorted((Path(__file__).parent / "bad_specs").glob("*.toml"))


def _expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name}: first line must be '# expect: <text>'"
    return first[len("# expect: "):]


def test_there_are_at_least_25_cases():
    assert len(BAD_SPECS) >= 25


@pytest.mark.parametrize("path", BAD_SPECS, ids=[p.stem for p in BAD_SPECS])
def test_bad_spec_is_one_line_with_key_path(path: Path, capsys):
    code = main(["plan", str(path)])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"lmc: error: {path}"), lines[0]
    assert _expected(path) in lines[0]
    assert "Traceback" not in captured.err


def test_bad_spec_exit_code_from_a_real_process():
    path = next(p for p in BAD_SPECS if "unknown-instance" in p.name)
    proc = subprocess.run([sys.executable, "-m", "lmc", "plan", str(path)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1
    assert "did you mean ml.g5.12xlarge" in proc.stderr


def test_missing_spec_file(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.toml")]) == 1
    assert capsys.readouterr().err == f"lmc: error: {tmp_path / 'nope.toml'}: no such spec file\n"


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan"])
    assert exc.value.code == 2
    assert "usage error" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["spec", "profile"])
def test_toml_nested_too_deeply_is_one_line_not_an_internal_error(where, tmp_path, capsys):
    """tomllib recurses per nesting level: thousands of `[` overflowed Python's stack (exit 70 before)."""
    deep = "x = " + "[" * 5000 + "]" * 5000 + "\n"
    spec = tmp_path / "spec.toml"
    body = '[model]\nid = "gpt-j-6b"\n[target]\ninstance = "ml.g5.12xlarge"\n'
    if where == "spec":
        spec.write_text(body + "[extra]\n" + deep)
        expected = f"lmc: error: {spec}: malformed TOML: arrays or tables nested too deeply"
    else:
        (tmp_path / "p.toml").write_text('base = "ml.g5.12xlarge"\n' + deep)
        spec.write_text(body + 'profile = "p.toml"\n')
        expected = f"lmc: error: {spec}:5: target.profile = "
    code = main(["plan", str(spec)])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith(expected), err
    assert "nested too deeply" in err


def test_a_nul_in_the_profile_path_is_one_line(tmp_path, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text('[model]\nid = "gpt-j-6b"\n[target]\ninstance = "ml.g5.12xlarge"\nprofile = "x\\u0000y.toml"\n')
    code = main(["plan", str(spec)])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1 and "target.profile" in err and "INTERNAL" not in err, err
