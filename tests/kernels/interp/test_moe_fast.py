"""The group-scaled MXFP4 expert GEMMs (``MoeConfig.fp4_path="group_scaled"``: e2m1 codes as fp16
bits, e4m3 activations, fp16 MMAs per 32-wide K group, scales applied to the partial sums)
against the torch twin and the dequant path, in the Triton interpreter at tiny shapes.

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
from interp_helpers import rel_err  # noqa: E402

E8M0 = torch.float8_e8m0fnu


def _fp4_experts(E: int, D: int, inter: int, gen: torch.Generator, act_block,
                 scale_lo: int = 118, scale_hi: int = 124) -> ref.ExpertWeights:
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8)
        s = torch.randint(scale_lo, scale_hi, (E, n, k // 32), generator=gen)
        return w.view(torch.int8), s.to(torch.uint8).view(E8M0)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ref.ExpertWeights(w1, w3, w2, act_block, "fp4", s1, s3, s2)


def _routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def _run(x, ids, w, ex, path: str, bm: int = 16, bn_up: int = 64, bn_down: int = 64):
    cfg = tri.MoeConfig(BM=bm, BN_up=bn_up, BN_down=bn_down, fp4_path=path)
    return tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)


@pytest.mark.parametrize("T,plan,D", [(1, (16, 64, 128), 256), (7, (16, 32, 64), 128),
                                      (30, (32, 128, 128), 128), (30, (64, 128, 64), 128)])
def test_group_scaled_matches_twin_fp32(T: int, plan, D: int) -> None:
    """fp32 compute: the same exact products summed in another fp32 order (rel ~1e-7)."""
    gen = torch.Generator().manual_seed(T + plan[1])
    E, inter, k = 6, 128, 3
    ex = _fp4_experts(E, D, inter, gen, 128)
    x = torch.randn(T, D, generator=gen) * 2
    ids, w = _routing(T, E, k, gen)
    if T > 1:
        ids[0, 1] = -1          # skipped picks (other shards)
        ids[T - 1, 0] = E + 2
    y = _run(x, ids, w, ex, "group_scaled", *plan)
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    assert y.shape == (T, D) and torch.isfinite(y).all()
    assert rel_err(y, y_ref) < 1e-5
    assert rel_err(y, _run(x, ids, w, ex, "dequant", *plan)) < 1e-5


@pytest.mark.parametrize("act_block", [32, 64, 128])
def test_group_scaled_bf16_official_block_sizes(act_block: int) -> None:
    """bf16 compute with FP8 activations per act_block (1, 2 or 4 groups per block)."""
    gen = torch.Generator().manual_seed(act_block)
    E, D, inter, k, T = 4, 128, 128, 2, 9
    ex = _fp4_experts(E, D, inter, gen, act_block)
    x = (torch.randn(T, D, generator=gen) * 3).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    y = _run(x, ids, w, ex, "group_scaled")
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    assert torch.isfinite(y).all()
    # bf16 intermediates: a one-ulp flip of one activation moves the output by ~4e-3 rel.
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(y, _run(x, ids, w, ex, "dequant")) < 1e-2


def test_group_scaled_every_code_scale_and_row_magnitude() -> None:
    """All 256 byte values, scales 2^-27..2^12, rows of magnitude 1e-3 .. 1e3 (activation
    exponents -20..+2): the power-of-two bookkeeping of codes, weight and activation scales."""
    gen = torch.Generator().manual_seed(0)
    E, D, inter = 1, 512, 128
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    w1 = codes.repeat(inter, 1).view(1, inter, D // 2)
    s1 = torch.randint(100, 140, (1, inter, D // 32), generator=gen).to(torch.uint8).view(E8M0)
    base = _fp4_experts(E, D, inter, gen, 128)
    ex = ref.ExpertWeights(w1, w1.roll(1, dims=2), base.w2, 128, "fp4", s1, s1.roll(3, dims=2),
                           base.s2)
    x = torch.randn(6, D, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    x[2, 100:200] *= 1e-4      # a block with a much smaller amax than its row
    ids = torch.zeros(6, 1, dtype=torch.int64)
    w = torch.ones(6, 1)
    cfg = tri.MoeConfig(BM=16, BN_up=64, BN_down=128, fp4_path="group_scaled")
    y = tri.moe_experts_with_config(x, ids, w, ex, 0.0, cfg)
    y_ref = ref.moe_experts(x, ids, w, ex, 0.0)
    for t in range(6):   # per row: a global norm would hide the small rows
        assert rel_err(y[t], y_ref[t]) < 1e-5, t


def test_group_scaled_falls_back_without_act_quant() -> None:
    """Without act_block (bf16 numerics) the activation is not exact in fp16: the dequant
    kernel runs, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    E, D, inter, k, T = 4, 128, 64, 2, 5
    ex = _fp4_experts(E, D, inter, gen, None)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    gs = tri.MoeConfig(BM=16, BN_up=64, BN_down=64, fp4_path="group_scaled")
    assert tri.resolve_fp4_path(gs, ex) == "dequant"
    assert torch.equal(_run(x, ids, w, ex, "group_scaled"), _run(x, ids, w, ex, "dequant"))
    quant = ref.ExpertWeights(ex.w1, ex.w3, ex.w2, 128, "fp4", ex.s1, ex.s3, ex.s2)
    assert tri.resolve_fp4_path(gs, quant) == "group_scaled"
    assert tri.resolve_fp4_path(tri.MoeConfig(16, 64, 64), quant) == "dequant"


def test_moe_config_validation_and_default_path() -> None:
    with pytest.raises(ValueError, match="fp4_path"):
        tri.MoeConfig(16, 64, 64, fp4_path="fast")
    with pytest.raises(ValueError, match="BN_up"):
        tri.MoeConfig(16, 48, 64)
    assert tri.FP4_PATH in tri.FP4_PATHS
    assert tri.pick_moe_config(6, 256, 4096, 2048, 128).fp4_path == tri.FP4_PATH


def test_bench_moe_decode_tiny_runs_end_to_end() -> None:
    """bench/moe_decode.py --tiny (what the GPU session runs at V4-Flash shapes): both paths
    agree with each other and the twin, and the plan kernel equals its twin."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "moe_decode.py"
    spec = importlib.util.spec_from_file_location("moe_decode_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--tiny", "--tokens", "2"])
    (row,) = out["rows"]
    assert row["finite"] and row["rel_gs_twin"] < 1e-2 and row["rel_gs_dq"] < 1e-2
    assert row["dequant_us"] > 0 and row["group_scaled_us"] > 0
    assert all(p["same"] for p in out["plan"])
