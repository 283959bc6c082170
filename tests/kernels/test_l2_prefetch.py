"""``l2_prefetch`` (dsv4.ops.triton_prefetch, a bench experiment): the XOR of a tensor's words
from the Triton kernel against the torch twin, in the interpreter (a child process) and on the
GPU (skipped without CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsv4.ops import triton_prefetch as tp


def test_twin_xor_and_errors() -> None:
    t = torch.tensor([1, 2, 4, 8, -1], dtype=torch.int32)
    assert int(tp.l2_prefetch_torch(t)) == (1 ^ 2 ^ 4 ^ 8 ^ -1)
    assert int(tp.l2_prefetch(t)) == int(tp.l2_prefetch_torch(t))   # off GPU: the twin
    with pytest.raises(ValueError, match="whole number"):
        tp.l2_prefetch(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        tp.l2_prefetch(torch.zeros(4, 4).t())


_CHILD = """
import torch
from dsv4.ops import triton_prefetch as tp
gen = torch.Generator().manual_seed(0)
for n, programs, block in ((4096, 1, 256), (1000, 3, 128), (12345, 0, 512), (8, 2, 128)):
    t = torch.randint(0, 256, (n * 4,), generator=gen, dtype=torch.uint8)
    for ev in (False, True):
        got = tp.l2_prefetch(t, programs, block, ev)
        assert torch.equal(got, tp.l2_prefetch_torch(t)), (n, programs, block, ev)
print("ok")
"""


def test_kernel_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in ((32768, 1024), (4096, 8192), (1000, 36)):
        w = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8)
        ref = int(tp.l2_prefetch_torch(w))
        got = tp.l2_prefetch(w)
        assert int(got) == ref, shape
