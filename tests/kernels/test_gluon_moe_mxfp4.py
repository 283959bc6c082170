"""The host side of the Gluon prefill expert GEMMs on the MXFP4 stacks (dsv4.ops.gluon_moe_mxfp4)
on the CPU: the MMA column order, the tile plans' checks and N tiles, and where a call takes
them (sm_90 GPUs only: never here, so the CPU keeps the other paths).  The kernels have no
interpreter: tests/kernels/sm90_cases.py compiles them for sm_90, and
tests/kernels/test_moe_fp8mma_gpu.py::test_fp8mma_mx_gemms_gpu checks their bits on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import gluon_moe_mxfp4 as mx
from dsv4.ops import triton_moe_fp8 as f8
from dsv4.ops.torch_dense import ExpertWeights


def test_mx_k_position_is_a_permutation_within_each_group() -> None:
    k = torch.arange(256)
    pos = mx.mx_k_position(k)
    assert torch.equal(pos.sort().values, k)
    assert torch.equal(pos // 32, k // 32)
    # Lane q's packed word (natural 8q .. 8q + 7) fills columns 4q .. 4q + 3 and 16 + 4q ...
    for q in range(4):
        assert [mx.mx_k_position(8 * q + j) for j in range(8)] == \
            [4 * q + j for j in range(4)] + [16 + 4 * q + j for j in range(4)]


@pytest.mark.parametrize("kwargs", [
    {"BM": 48}, {"warps": 2}, {"mt": 3}, {"stages": 1}, {"stages": 7}, {"BM": 256},
    {"BM": 64, "dec": True}, {"dec": True, "warps": 8}, {"dec": True, "mt": 2},
    {"dec": True, "regs": 20}, {"dec": True, "dregs": 100}, {"persist": True},
    {"dec": True, "chain": 2}, {"dec": True, "persist": True, "chain": 3}])
def test_plan_checks(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        mx.MxPlan(**kwargs)


def test_plan_tiles_and_defaults() -> None:
    assert mx.MxPlan(warps=8, mt=1).BN == 128
    assert mx.MxPlan(warps=4, mt=2).BN == 128
    dec = mx.MxPlan(BM=256, dec=True)
    assert dec.BN == 64   # the rows of w1 and of w3 (up), of w2 (down)
    # The measured defaults (docs/PERFORMANCE.md, thirty-sixth and thirty-eighth sessions):
    # 128-row blocks for both GEMMs (one plan for the call), the up GEMM with a decode
    # warpgroup in its persistent form, the down GEMM plain.
    assert mx.PLAN_UP.BM == mx.PLAN_DOWN.BM == 128 and mx.PLAN_UP.dec
    if "DSV4_FP8MMA_MX_PLANS" not in os.environ:
        assert mx.PLAN_UP.persist and mx.PLAN_UP.chain == 2 and not mx.PLAN_DOWN.dec
    if "DSV4_FP8MMA_MX" not in os.environ:
        assert mx.MX_PREFILL


def test_small_calls_take_64_row_plans() -> None:
    """Up to SMALL_PAIRS pairs an expert (the mean: 2K-token steps of V4-Flash, 48) the call
    takes the plain 64-row plans, beyond them the defaults; both GEMMs of a call share the
    row blocks."""
    if "DSV4_FP8MMA_MX_SMALL_PLANS" not in os.environ:
        assert mx.PLAN_UP_SMALL == mx.PLAN_DOWN_SMALL == mx.MxPlan(BM=64, stages=4)
    E = 256
    assert mx.plans_for(2048 * 6, E) == (mx.PLAN_UP_SMALL, mx.PLAN_DOWN_SMALL)
    assert mx.plans_for(mx.SMALL_PAIRS * E, E) == (mx.PLAN_UP_SMALL, mx.PLAN_DOWN_SMALL)
    assert mx.plans_for(mx.SMALL_PAIRS * E + 1, E) == (mx.PLAN_UP, mx.PLAN_DOWN)
    assert mx.plans_for(8192 * 6, E) == (mx.PLAN_UP, mx.PLAN_DOWN)
    for up, down in (mx.plans_for(1, E), mx.plans_for(10 ** 6, E)):
        assert up.BM == down.BM


def test_whole_stacks() -> None:
    """The persistent form's TMA views need whole stacks; a view into larger ones (e.g. a
    slice of the rows) makes the launch fall back to the non-persistent form."""
    E, N, K = 3, 128, 256
    w = torch.zeros(E, N, K // 2, dtype=torch.uint8)
    sc = torch.zeros(E, N, K // 32, dtype=torch.uint8)
    assert mx._whole_stacks(w, sc, w, sc, N, K)
    assert mx._whole_stacks(w[1:], sc[1:], w[1:], sc[1:], N, K)   # an expert range: whole
    big = torch.zeros(E, 2 * N, K // 2, dtype=torch.uint8)
    assert not mx._whole_stacks(big[:, :N], sc, w, sc, N, K)


def _stacks(kchunk: int) -> ExpertWeights:
    E, D, inter = 2, 256, 128

    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(E, n, k // 2, dtype=torch.int8),
                torch.full((E, n, k // 32), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu))

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128, kchunk)


def test_never_on_the_cpu() -> None:
    """qualifies needs an sm_90 CUDA tensor: a CPU call keeps the re-encoding path (and its
    pair threshold)."""
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert not mx.qualifies(x, 128, 128, 256, 128)
    assert not f8.mx_applies(x, _stacks(128))
    assert not f8.mx_applies(x, _stacks(0))


def test_qualifies_needs_kchunk_stacks_and_whole_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape conditions, with the device check stubbed to an sm_90 GPU."""
    class _Cuda:
        is_cuda = True
        device = "cuda:0"

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    if not mx.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    x = _Cuda()
    assert mx.qualifies(x, 128, 128, 4096, 2048)
    assert not mx.qualifies(x, 0, 128, 4096, 2048)           # row-major stacks
    assert not mx.qualifies(x, 128, 32, 4096, 2048)          # V4.1's act block 32
    assert not mx.qualifies(x, 128, 128, 4096, 2048 + 64)    # I not a multiple of 128
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not mx.qualifies(x, 128, 128, 4096, 2048)


def test_parse_plan() -> None:
    """The plans' text form (bench/moe_gluon_mx.py, DSV4_FP8MMA_MX_PLANS)."""
    assert mx.parse_plan("128:4:1:3") == mx.MxPlan(BM=128, stages=3)
    assert mx.parse_plan("128:4:1:4:dec") == mx.MxPlan(BM=128, stages=4, dec=True)
    assert mx.parse_plan("128:4:1:4:pdec2") == mx.MxPlan(BM=128, stages=4, dec=True,
                                                         persist=True, chain=2)
    assert mx.parse_plan("128:4:1:4:pdec") == mx.MxPlan(BM=128, stages=4, dec=True,
                                                        persist=True)
    for bad in ("128:4:1", "128:4:1:3:wide", "128:4:1:3:pdecx", "x:4:1:3", "48:4:1:3",
                "128:4:1:3:pdec3", "128:4:1:4:pdec2t"):
        with pytest.raises(ValueError):
            mx.parse_plan(bad)


def test_registers_per_form() -> None:
    """The decode-warpgroup forms' registers: 192 / 112 (the default consumer partition gets
    the remaining 168); the persistent forms balanced per GEMM, where their chained products
    compile without spills; explicit values kept."""
    dec = mx.MxPlan(BM=128, dec=True)
    assert dec.registers(True) == dec.registers(False) == (192, 112)
    pdec = mx.MxPlan(BM=128, dec=True, persist=True, chain=2)
    assert pdec.registers(True) == (184, 104) and pdec.registers(False) == (176, 112)
    assert mx.MxPlan(BM=128, dec=True, regs=160).registers(True) == (160, 112)
    # consumer, consumer, decoder, the load warp as a warpgroup of 40: the 64K registers
    for two in (True, False):
        regs, dregs = pdec.registers(two)
        assert 128 * (2 * regs + dregs + 40) <= 65536
