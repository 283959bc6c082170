"""Run a test file's interpreter tests in a child pytest with ``TRITON_INTERPRET=1``.

Triton wraps kernels when they are decorated, so the interpreter has to be chosen before triton
is imported: kernel test files keep their ``test_interp_*`` tests in the file and run them in a
child process from the parent suite (CUDA hidden), while the GPU tests of the same file run in the
parent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_in_interpreter(test_file: str, keyword: str = "interp_", min_passed: int = 1) -> None:
    """Run the tests of ``test_file`` selected by ``-k keyword`` under the interpreter; fail
    with the child's output unless it exits 0 with at least ``min_passed`` tests passed."""
    pytest.importorskip("triton")
    import numpy
    if tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 3):
        # triton 3.6's interpreter fails on loops over run-time bounds with numpy >= 2.3
        # ("only 0-dimensional arrays can be converted to Python scalars"); the project pins
        # numpy<2.3 where the interpreter runs (CI), the GPU machine's image has 2.5.
        pytest.skip(f"the Triton interpreter needs numpy<2.3; found {numpy.__version__}")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", keyword,
         str(Path(test_file).resolve())], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, (f"interpreter tests failed (rc={proc.returncode}):\n"
                                  f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed and " failed" not in proc.stdout, \
        f"interpreter tests did not run as expected:\n{proc.stdout[-3000:]}"
