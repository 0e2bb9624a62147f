"""The host-side scripts are files (orchestrator/host/*.sh) that shellcheck passes, loaded as sent;
no long script is left inside a Python string."""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator import host

PACKAGE = Path(host.__file__).resolve().parent.parent
SCRIPTS = sorted(Path(host.__file__).parent.glob("*.sh"))
LONGEST_STRING = 40      # lines: a string this long belongs in a file of its own


def test_the_host_scripts_are_there():
    assert {p.stem for p in SCRIPTS} >= {"ownership", "lock", "begin_sync", "finish_sync", "gpu_claim", "doctor_probe", "step_guard"}


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (.ci/run installs it)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_host_script_passes_shellcheck(script):
    proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_python_string_of_40_lines_or_more_holds_a_script():
    """Docstrings aside, every string constant of the package is shorter than LONGEST_STRING lines."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        long += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} ({node.value.count(chr(10)) + 1} lines)"
                 for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                 and node.value.count("\n") + 1 >= LONGEST_STRING]
    assert not long, f"scripts inside Python strings (move them to orchestrator/host/*.sh): {long}"


def test_a_script_is_sent_without_its_leading_comments_and_with_its_values(tmp_path):
    finish = host.script_text("finish_sync", FINISH_TAIL=8192)
    source = (Path(host.__file__).parent / "finish_sync.sh").read_text()
    assert source.startswith("# shellcheck shell=bash\n") and not finish.startswith("#")
    assert "tail -c 8192 |" in finish and "FINISH_TAIL" not in finish
    assert source.endswith(finish.replace("tail -c 8192 |", "tail -c @FINISH_TAIL@ |"))
    with pytest.raises(ValueError, match="no value given for @FINISH_TAIL@"):
        host.script_text("finish_sync")
    with pytest.raises(ValueError, match="has no placeholder @OTHER@"):
        host.script_text("finish_sync", FINISH_TAIL=1, OTHER=2)


def test_every_host_script_as_sent_is_bash_that_parses():
    """Each file, as sent (placeholders filled), is bash that parses (`bash -n`)."""
    values = {"finish_sync": {"FINISH_TAIL": 8192}, "build_check": {"MATCHED": "MATCHED", "NO_MATCH": 10}}
    for script in SCRIPTS:
        text = host.script_text(script.stem, **values.get(script.stem, {}))
        proc = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
        assert proc.returncode == 0, (script.name, proc.stderr)
