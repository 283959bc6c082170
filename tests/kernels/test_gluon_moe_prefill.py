"""The host side of the Gluon prefill expert GEMMs (dsv4.ops.gluon_moe_prefill) on the CPU: where
DSV4_FP8MMA_GLUON sends an expert call, the tile plans' checks, and that the expert call keeps
the Triton kernels where the Gluon ones cannot run.  The kernels themselves have no interpreter:
tests/kernels/sm90_cases.py compiles them for sm_90, tests/kernels/test_moe_fp8mma_gpu.py checks
their bits on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.ops import gluon_moe_prefill as gp


@pytest.mark.parametrize("setting, kept, want", [
    ("kept", True, True), ("kept", False, False), ("1", True, True), ("1", False, True),
    ("0", True, False), ("0", False, False)])
def test_enabled_follows_the_setting(setting: str, kept: bool, want: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gp, "GLUON_PREFILL", setting)
    assert gp.enabled(kept) is want


def test_defaults_are_on() -> None:
    """The Gluon GEMMs on codes run every FP8-MMA expert call by default, the warp-specialized
    tiles skipping other chunks' blocks (measured: docs/PERFORMANCE.md, thirty-sixth
    session)."""
    if "DSV4_FP8MMA_GLUON" in os.environ or "DSV4_GLUON_WS_SKIP" in os.environ:
        pytest.skip("DSV4_FP8MMA_GLUON or DSV4_GLUON_WS_SKIP is set")
    assert gp.GLUON_PREFILL == "1" and gp.WS_SKIP


@pytest.mark.parametrize("kwargs", [
    {"BM": 32}, {"BN": 48}, {"warps": 8, "BM": 64}, {"stages": 1}, {"stages": 9},
    {"ws": True, "lag": True}, {"ws": True, "BN": 32}])
def test_plan_checks(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        gp.GluonGemmPlan(**kwargs)


def test_default_plans() -> None:
    assert gp.PLAN_UP.ws and gp.PLAN_DOWN.ws
    assert gp.PLAN_UP.BM == gp.PLAN_DOWN.BM == 64


def test_qualifies_needs_an_sm90_gpu() -> None:
    x = torch.zeros(4, 4096, dtype=torch.bfloat16)
    assert not gp.qualifies(x, 4096, 2048, 128, gp.PLAN_UP)
