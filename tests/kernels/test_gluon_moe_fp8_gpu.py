"""The Gluon GEMMs of the predecoded FP8 expert path (dsv4.ops.gluon_moe_fp8) on the GPU at
V4-Flash widths (D 4096, I 2048, 256 experts, top-6), official numerics, bf16: the whole
expert call with them against the same call with the Triton kernels — the same products, the
same fp32 fma per K step in the same order, the same epilogues, so the same bits — under each
plan of bench/gluon_gemm.py, with short last chunks of predecoded experts, padding rows, unused
blocks and a skipped pick; and against the torch twin (the FP8 path's bound).  Gluon has no
interpreter: off an sm_90 GPU only the host-side checks run (their CPU test is the offline
sm_90 compile in tests/kernels/sm90_cases.py)."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import gluon_moe_fp8 as glm
from dsv4.ops import triton_moe_fp8 as f8
from tests.kernels.test_gpu_kernels import _poison, _rel
from tests.kernels.test_moe_fp8mma_gpu import REL_BOUND, _routing, _stacks

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    or not glm.HAVE_GLUON or torch.cuda.get_device_capability()[0] != 9,
    reason="needs an sm_90 GPU, Gluon and TRITON_INTERPRET unset")

DEV = "cuda"
D, INTER = 4096, 2048
PLANS = [glm.DEFAULT_PLAN, glm.GluonPlan(64, 128, 128, 8, 8, 4, 2, 4),
         glm.GluonPlan(64, 64, 64, 8, 4, 3, 4, 8), glm.GluonPlan(128, 64, 128, 8, 8, 4, 2, 2)]


@needs_hopper
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.BM}x{p.BN_up}x{p.BN_down}"
                         f"_w{p.warps_up}{p.warps_down}_s{p.stages}_u{p.unroll_up}{p.unroll_down}")
def test_gluon_gemms_same_bits_gpu(plan: glm.GluonPlan, monkeypatch: pytest.MonkeyPatch) -> None:
    """2048 tokens, experts re-encoded 37 at a time (a short last chunk), one skipped pick:
    the Gluon GEMMs give the Triton kernels' bits (the routing plan at the Gluon plan's BM
    for both), finite everywhere, the twin to REL_BOUND."""
    from dsv4.ops import torch_dense as ref
    monkeypatch.setattr(glm, "DEFAULT_PLAN", plan)
    monkeypatch.setattr(f8, "PREDECODE_BYTES", 2 * INTER * D * 37)
    ex = _stacks(torch.Generator(device=DEV).manual_seed(51))
    T = 2048
    gen = torch.Generator(device=DEV).manual_seed(52)
    x = (torch.randn(T, D, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    ids, w = _routing(T, gen)
    ids[7, 2] = -1
    cfg = f8.MoeFp8Config(BM=plan.BM, BN_up=128, BN_down=128, warps_up=8, warps_down=8,
                          stages=4)
    _poison()
    y_gl = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg, predecode=True, gluon=True)
    _poison()
    y_tr = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg, predecode=True, gluon=False)
    assert bool(torch.isfinite(y_gl).all())
    assert torch.equal(y_gl, y_tr), f"rel {_rel(y_gl, y_tr):.2e}"
    assert _rel(y_gl, ref.moe_experts(x, ids, w, ex, 10.0)) < REL_BOUND


@needs_hopper
def test_gluon_gemms_few_rows_gpu() -> None:
    """40 tokens over 256 experts (most blocks one or two real rows, many experts unused):
    the same bits as the Triton kernels; the env switch's default path is the Triton one."""
    ex = _stacks(torch.Generator(device=DEV).manual_seed(53))
    gen = torch.Generator(device=DEV).manual_seed(54)
    x = (torch.randn(40, D, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    ids, w = _routing(40, gen)
    cfg = f8.MoeFp8Config(BM=glm.DEFAULT_PLAN.BM, stages=4)
    y_gl = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg, predecode=True, gluon=True)
    y_tr = f8.moe_experts_fp8mma(x, ids, w, ex, 10.0, cfg, predecode=True, gluon=False)
    assert torch.equal(y_gl, y_tr), f"rel {_rel(y_gl, y_tr):.2e}"


def test_gluon_plan_and_shape_checks() -> None:
    """Host-side checks (run everywhere): plan fields, the K step, K a multiple of the unroll."""
    with pytest.raises(ValueError, match="BM"):
        glm.GluonPlan(BM=32)
    with pytest.raises(ValueError, match="unroll"):
        glm.GluonPlan(unroll_up=3)
    with pytest.raises(ValueError, match="stages"):
        glm.GluonPlan(stages=1)
    if not glm.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    e4 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="K step 128"):
        glm._check(32, 2, torch.empty(64, 256, dtype=torch.uint8).view(e4))
    with pytest.raises(ValueError, match="multiple of 1024"):
        glm._check(128, 8, torch.empty(64, 512, dtype=torch.uint8).view(e4))
    glm._check(128, 4, torch.empty(64, 512, dtype=torch.uint8).view(e4))
    # Off CUDA the expert call never takes the Gluon kernels (no interpreter for them).
    x = torch.empty(8, 4096, dtype=torch.bfloat16)
    assert not f8._gluon_applies(x, 128, 4096, 2048, True, True)
