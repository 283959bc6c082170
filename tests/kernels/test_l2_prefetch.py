"""``l2_prefetch`` (dsv4.ops.triton_prefetch, a bench experiment): the XOR of a tensor's words
from the Triton kernel against the torch twin, in the interpreter (a child process) and on the
GPU (skipped without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import triton_prefetch as tp
from tests.kernels.interp_child import run_in_interpreter

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def test_twin_xor_and_errors() -> None:
    t = torch.tensor([1, 2, 4, 8, -1], dtype=torch.int32)
    assert int(tp.l2_prefetch_torch(t)) == (1 ^ 2 ^ 4 ^ 8 ^ -1)
    if not _INTERP:
        assert int(tp.l2_prefetch(t)) == int(tp.l2_prefetch_torch(t))   # off GPU: the twin
    with pytest.raises(ValueError, match="whole number"):
        tp.l2_prefetch(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        tp.l2_prefetch(torch.zeros(4, 4).t())


@pytest.mark.skipif(not _INTERP, reason="runs in the interpreter child")
@pytest.mark.parametrize("n,programs,block", [(4096, 1, 256), (1000, 3, 128), (12345, 0, 512),
                                              (8, 2, 128)])
@pytest.mark.parametrize("evict_last", [False, True])
def test_interp_kernel_equals_twin(n: int, programs: int, block: int, evict_last: bool) -> None:
    gen = torch.Generator().manual_seed(n)
    t = torch.randint(0, 256, (n * 4,), generator=gen, dtype=torch.uint8)
    assert torch.equal(tp.l2_prefetch(t, programs, block, evict_last), tp.l2_prefetch_torch(t))


@pytest.mark.skipif(_INTERP, reason="parent process only")
def test_kernel_in_interpreter() -> None:
    run_in_interpreter(__file__, min_passed=8)


@pytest.mark.skipif(not torch.cuda.is_available() or _INTERP, reason="needs CUDA")
def test_kernel_on_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in ((32768, 1024), (4096, 8192), (1000, 36)):
        w = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8)
        for evict_last in (False, True):
            assert int(tp.l2_prefetch(w, evict_last=evict_last)) == int(tp.l2_prefetch_torch(w))
