"""Run the Triton-interpreter kernel tests (``interp/``) in a child process with
``TRITON_INTERPRET=1``, one child per test file, so the variable stays out of this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FILES = sorted(p.name for p in (HERE / "interp").glob("test_*.py"))


@pytest.mark.parametrize("name", FILES)
def test_interpreter_file(name: str) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET is set: interp/ tests are collected directly")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    # The interpreter runs on CPU tensors; keep the child off any GPU.
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         str(HERE / "interp" / name)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (
        f"interpreter tests in {name} failed (rc={proc.returncode}):\n"
        f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
