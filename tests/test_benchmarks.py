"""benchmarks/ is a package: its scripts import one another as `benchmarks.*`, and run both
as modules (`python -m benchmarks.X`) and as files (`python benchmarks/X.py`)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_imports_as_part_of_the_package(name: str) -> None:
    importlib.import_module(f"benchmarks.{name}")


def test_only_the_bootstrap_touches_sys_path() -> None:
    """One place (benchmarks/_repo_root.py) makes the root importable for a script run as a
    file; no script edits sys.path or imports a sibling by its bare name."""
    siblings = "|".join(name for name in SCRIPTS if name != "_repo_root")
    for name in SCRIPTS:
        if name == "_repo_root":
            continue
        code = (REPO / "benchmarks" / f"{name}.py").read_text()
        assert not re.search(r"sys\.path\.(insert|append)|sys\.path\[", code), name
        assert not re.search(rf"^\s*(import|from) ({siblings})\b", code, re.M), name


def test_a_script_runs_the_same_as_a_module_and_as_a_file(tmp_path: Path) -> None:
    """compare.py's --print-commands, from the root both ways, and as a file from elsewhere
    (the bootstrap finds the root from the script's own path)."""
    argv = ["--print-commands", "--model", str(tmp_path / "m.gguf"), "--only", "llama-server"]
    env = {**os.environ, "COLUMNS": "200"}

    def run(args: list[str], cwd: Path) -> str:
        done = subprocess.run([sys.executable, *args, *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    as_module = run(["-m", "benchmarks.compare"], REPO)
    assert run(["benchmarks/compare.py"], REPO) == as_module
    assert run([str(REPO / "benchmarks" / "compare.py")], tmp_path) == as_module
    assert "-np 8 -t 2 -tb 2 -c 32768" in as_module
