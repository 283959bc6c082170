"""The routed experts as independent K-step units (dsv4.ops.triton_moe_units, one or two
tokens) in the Triton interpreter at tiny shapes: against the twin and the split-K plans for
MXFP4 (row-major and K-chunk-major), FP8 and dense stacks, with skipped picks, shared experts,
more programs than units, bf16 and fp32 compute; bit-reproducible; the plan flag.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402
from dsv4.ops import triton_moe_units as units  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

E8M0 = torch.float8_e8m0fnu


def _experts(fmt: str, E: int, D: int, inter: int, gen: torch.Generator,
             act_block: int | None) -> ref.ExpertWeights:
    def stack(n: int, k: int):
        if fmt == "fp4":
            w = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8)
            s = torch.randint(118, 124, (E, n, k // 32), generator=gen).to(torch.uint8)
            return w.view(torch.int8), s.view(E8M0)
        if fmt == "fp8":
            w = (torch.randn(E, n, k, generator=gen) * 40).clamp(-448, 448)
            s = torch.rand(E, n // 128, k // 128, generator=gen) * 0.01 + 0.001
            return w.to(torch.float8_e4m3fn), s
        return torch.randn(E, n, k, generator=gen) * 0.05, None

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ref.ExpertWeights(w1, w3, w2, act_block, fmt, s1, s3, s2, block=128)


def _routing(T: int, E: int, k: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def _cfg(per_sm: int) -> tri.MoeConfig:
    return tri.MoeConfig(BM=16, BN_up=32, BN_down=64, split_up=2, split_down=2, units=per_sm)


# per_sm × 4 interpreter "SMs": 4 programs (long unit ranges over several tiles), 40 (more
# programs than units at one token: empty programs).
@pytest.mark.parametrize("per_sm,T", [(1, 1), (10, 1), (3, 2)])
def test_units_match_twin_and_split_fp4(per_sm: int, T: int) -> None:
    gen = torch.Generator().manual_seed(per_sm * 10 + T)
    E, D, inter, k = 6, 256, 256, 4
    ex = _experts("fp4", E, D, inter, gen, 128)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    if T > 1:
        ids[1, :2] = ids[0, :2]     # shared experts: fewer used blocks than the plan's bound
        ids[1, 3] = -1              # a skipped pick (another shard)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(per_sm))
    assert y.shape == (T, D) and torch.isfinite(y).all()
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5
    split = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(0))
    assert rel_err(y, split) < 1e-6
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(per_sm)))
    # K-chunk-major stacks: the same bits.
    ch = ref.kchunk_experts(ex, 128)
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ch, 10.0, _cfg(per_sm)))


@pytest.mark.parametrize("fmt,act_block", [("fp8", 128), ("dense", None), ("fp4", None)])
def test_units_other_formats(fmt: str, act_block) -> None:
    gen = torch.Generator().manual_seed(7)
    E, D, inter, k, T = 4, 256, 128, 2, 2
    ex = _experts(fmt, E, D, inter, gen, act_block)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    cfg = tri.MoeConfig(BM=16, BN_up=64, BN_down=128, units=2)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5


def test_units_bf16_compute() -> None:
    """bf16 activations: gate / up sums rounded to bf16 before the SwiGLU, the activation and
    each pick's w2 output rounded to bf16, as the twin and the split-K kernels."""
    gen = torch.Generator().manual_seed(11)
    E, D, inter, k, T = 6, 256, 256, 4, 1
    ex = _experts("fp4", E, D, inter, gen, 128)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(3))
    split = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(0))
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2
    assert rel_err(y, split) < 1e-2


def test_units_plan_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """pick_moe_config turns units on only with DSV4_MOE_UNITS (MOE_UNITS) and a few pairs."""
    assert tri.pick_moe_config(6, 256, 4096, 2048, 128).units == (
        units.UNITS_PER_SM if units.MOE_UNITS else 0)
    monkeypatch.setattr(units, "MOE_UNITS", True)
    assert tri.pick_moe_config(6, 256, 4096, 2048, 128).units == units.UNITS_PER_SM
    assert tri.pick_moe_config(units.UNITS_MAX_PAIRS + 1, 256, 4096, 2048, 128).units == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="units"):
            tri.MoeConfig(BM=16, BN_up=32, BN_down=64, units=bad)
