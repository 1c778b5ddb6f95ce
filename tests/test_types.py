"""The speculation core type-checks: mypy over the files `[tool.mypy]` in pyproject.toml lists (the engine,
the proposers, the trees, the scheduler), which also checks that the targets, policies and proposers conform
to drafttree.protocols."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_core_type_checks():
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"mypy found problems:\n{run.stdout}{run.stderr}"
