"""The L2 prefetches of dsv4.ops.triton_prefetch against their torch twins, in the interpreter
(a child process) and on the GPU (skipped without CUDA): ``l2_prefetch`` (the XOR of a tensor's
words), ``l2_bulk_prefetch`` and ``moe_l2_prefetch`` (the bytes they ask for)."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import triton_prefetch as tp
from dsv4.ops.torch_dense import ExpertWeights
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
    run_in_interpreter(__file__, min_passed=8 + 12 + 4 + 1)


@pytest.mark.skipif(not torch.cuda.is_available() or _INTERP, reason="needs CUDA")
def test_kernel_on_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in ((32768, 1024), (4096, 8192), (1000, 36)):
        w = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8)
        for evict_last in (False, True):
            assert int(tp.l2_prefetch(w, evict_last=evict_last)) == int(tp.l2_prefetch_torch(w))


def _stacks(E: int, D: int, inter: int, device: str = "cpu") -> ExpertWeights:
    """MXFP4 stacks of zeros (a prefetch never reads the values), K-chunk-major."""
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(E, n, k // 2, dtype=torch.int8, device=device),
                torch.zeros(E, n, k // 32, dtype=torch.uint8, device=device))

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128, 128)


def test_bulk_twins_and_errors() -> None:
    t = torch.zeros(1024, dtype=torch.uint8)
    assert int(tp.l2_bulk_prefetch_torch(t)) == 1024
    if not _INTERP:
        assert int(tp.l2_bulk_prefetch(t)) == 1024                # off GPU: the twin
    with pytest.raises(ValueError, match="16-byte"):
        tp.l2_bulk_prefetch(torch.zeros(24, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        tp.l2_bulk_prefetch(torch.zeros(16, 16).t())
    with pytest.raises(ValueError, match="chunk"):
        tp.l2_bulk_prefetch(t, chunk=24)
    ex = _stacks(8, 256, 128)
    ids = torch.tensor([[0, 7], [-1, 3], [8, 2]], dtype=torch.int32)   # -1 and 8 are skipped
    per_up = 2 * (128 * 128 + 128 * 8)                                  # w1, w3 + s1, s3
    assert int(tp.moe_l2_prefetch_torch(ids, ex)) == 4 * per_up
    assert int(tp.moe_l2_prefetch_torch(ids, ex, ("w2",))) == 4 * 256 * 64
    with pytest.raises(ValueError, match="unknown stack"):
        tp.moe_l2_prefetch_torch(ids, ex, ("w4",))
    with pytest.raises(ValueError, match="piece"):
        tp.moe_l2_prefetch(ids, ex, chunk=4096, piece=6144)


@pytest.mark.skipif(not _INTERP, reason="runs in the interpreter child")
@pytest.mark.parametrize("nbytes,programs,chunk,lanes", [(16, 1, 16, 1), (4096, 1, 256, 4),
                                                        (100000, 3, 512, 8), (65536, 0, 1024, 2),
                                                        (48, 4, 16, 2), (1 << 20, 2, 4096, 32)])
@pytest.mark.parametrize("evict_last", [False, True])
def test_interp_bulk_asks_for_every_byte(nbytes: int, programs: int, chunk: int, lanes: int,
                                         evict_last: bool) -> None:
    t = torch.zeros(nbytes, dtype=torch.uint8)
    got = tp.l2_bulk_prefetch(t, programs, chunk, evict_last, lanes)
    assert torch.equal(got, tp.l2_bulk_prefetch_torch(t))


@pytest.mark.skipif(not _INTERP, reason="runs in the interpreter child")
@pytest.mark.parametrize("which", [("w1", "w3", "s1", "s3"), ("w2", "s2"), ("s3",),
                                   ("w1", "w3", "s1", "s3", "w2", "s2")])
def test_interp_moe_prefetch_asks_for_the_picked_experts(which: tuple[str, ...]) -> None:
    ex = _stacks(8, 256, 128)
    for ids in (torch.tensor([[0, 7], [-1, 3], [8, 2]], dtype=torch.int32),
                torch.tensor([[5, 5, 1]], dtype=torch.int64)):
        for piece, chunk in ((4096, 1024), (1 << 20, 16384)):
            got = tp.moe_l2_prefetch(ids, ex, which, chunk=chunk, piece=piece, lanes=4)
            assert torch.equal(got, tp.moe_l2_prefetch_torch(ids, ex, which))


@pytest.mark.skipif(not _INTERP, reason="runs in the interpreter child")
def test_interp_moe_prefetch_no_picks() -> None:
    ex = _stacks(4, 128, 128)
    assert int(tp.moe_l2_prefetch(torch.zeros(0, 6, dtype=torch.int32), ex)) == 0
    assert int(tp.moe_l2_prefetch(torch.full((2, 3), 9, dtype=torch.int32), ex)) == 0


@pytest.mark.skipif(not torch.cuda.is_available() or _INTERP, reason="needs CUDA")
def test_bulk_prefetch_on_gpu() -> None:
    """The bulk prefetches ask for every byte on the H200 (the count is what the PTX lanes
    returned), in eager launches and CUDA-graph replays with new ids, and leave the data as it
    was."""
    w = torch.randint(0, 256, (32768, 1024), device="cuda", dtype=torch.uint8)
    before = w.clone()
    for programs, chunk in ((0, 16384), (8, 65536), (132, 4096)):
        for evict_last in (False, True):
            assert int(tp.l2_bulk_prefetch(w, programs, chunk, evict_last)) == w.numel()
    assert torch.equal(w, before)
    ex = _stacks(256, 4096, 2048, "cuda")
    ids = torch.randint(-1, 257, (4, 6), device="cuda", dtype=torch.int32)
    for which in (("w1", "w3", "s1", "s3"), ("w2", "s2")):
        assert int(tp.moe_l2_prefetch(ids, ex, which)) == int(tp.moe_l2_prefetch_torch(ids, ex,
                                                                                      which))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tp.moe_l2_prefetch(ids, ex)
    for _ in range(3):
        ids.copy_(torch.randint(-1, 257, (4, 6), device="cuda", dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        assert int(out) == int(tp.moe_l2_prefetch_torch(ids, ex))
