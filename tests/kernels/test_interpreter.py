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


def test_triton_ops_fall_back_to_twins_off_gpu() -> None:
    """Without the interpreter, the Triton ops on CPU tensors run their torch twins."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernels themselves on CPU")
    pytest.importorskip("triton")
    import torch

    from dsv4.ops import get_ops, torch_attn, torch_dense, triton_attn, triton_dense

    ops = get_ops("triton")
    assert ops.fp8_linear is triton_dense.fp8_linear and ops.sparse_attn is triton_attn.sparse_attn
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, generator=gen)
    w8 = torch.randn(64, 128, generator=gen).to(torch.float8_e4m3fn)
    ws = torch.rand(1, 1, generator=gen) + 0.5
    assert torch.equal(ops.fp8_linear(x, w8, ws, 128, torch.float32),
                       torch_dense.fp8_linear(x, w8, ws, 128, torch.float32))
    q = torch.randn(2, 4, 16, generator=gen)
    kv = torch.randn(5, 16, generator=gen)
    idx = torch.tensor([[0, 1, -1], [4, 2, 3]], dtype=torch.int32)
    sink = torch.zeros(4)
    assert torch.equal(ops.sparse_attn(q, kv, idx, None, None, sink, 0.25),
                       torch_attn.sparse_attn(q, kv, idx, None, None, sink, 0.25))
