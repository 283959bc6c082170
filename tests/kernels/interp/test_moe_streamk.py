"""The stream-K schedule of the routed-expert GEMMs (dsv4.ops.triton_moe_streamk) in the Triton
interpreter at tiny shapes: the twin and the grouped kernels' result for MXFP4 / FP8 / dense
stacks, tiles finished in place and tiles shared by up to all programs, programs with nothing to
do, experts shared by tokens (fewer used blocks than the plan's), skipped picks, counters left
at zero, bit-reproducible results.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_dense as td  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402
from dsv4.ops import triton_moe_streamk as sk  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

E8M0 = torch.float8_e8m0fnu


def _experts(fmt: str, E: int, D: int, inter: int, gen: torch.Generator,
             act_block: int | None) -> ref.ExpertWeights:
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def _routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def _cfg(per_sm: int, bn_up: int = 32, bn_down: int = 64) -> tri.MoeConfig:
    return tri.MoeConfig(BM=16, BN_up=bn_up, BN_down=bn_down, streamk=per_sm)


def test_plan_bounds_the_tiles_one_program_touches() -> None:
    """CT covers the worst start: a range of L units beginning on a tile's last step."""
    for G, nb, n_tiles, ks in ((4, 7, 4, 2), (528, 7, 32, 32), (528, 102, 16, 32), (12, 1, 1, 4),
                               (40, 2, 2, 2)):
        plan = sk.StreamKPlan(G, nb, n_tiles, ks)
        U = nb * n_tiles * ks
        most = 0
        for p in range(G):
            u0, u1 = p * U // G, (p + 1) * U // G
            if u0 < u1:
                most = max(most, (u1 - 1) // ks - u0 // ks + 1)
        assert most <= plan.tiles_per_program, (G, nb, n_tiles, ks)
    with pytest.raises(ValueError, match="positive"):
        sk.StreamKPlan(0, 1, 1, 1)


# per_sm × 4 interpreter "SMs": 4 programs (long ranges over several tiles), 12, and 40 (more
# programs than units at one token: single-unit ranges, empty programs, tiles of many programs).
@pytest.mark.parametrize("per_sm", [1, 3, 10])
@pytest.mark.parametrize("T", [1, 3])
def test_streamk_matches_twin_and_grouped_fp4(per_sm: int, T: int) -> None:
    gen = torch.Generator().manual_seed(per_sm * 10 + T)
    E, D, inter, k = 6, 256, 256, 4
    ex = _experts("fp4", E, D, inter, gen, 128)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    if T > 1:
        ids[1] = ids[0]             # shared experts: fewer used blocks than the plan's bound
        ids[2, 0] = -1              # skipped picks (other shards)
        ids[2, 3] = E + 1
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(per_sm))
    y_ref = ref.moe_experts(x, ids, w, ex, 10.0)
    assert y.shape == (T, D) and torch.isfinite(y).all()
    assert rel_err(y, y_ref) < 1e-5
    grouped = tri.moe_experts_with_config(x, ids, w, ex, 10.0,
                                          tri.MoeConfig(BM=16, BN_up=32, BN_down=64))
    assert rel_err(y, grouped) < 1e-6
    # Bit-reproducible, and every arrival counter is back at zero.
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(per_sm)))
    assert int(td.splitk_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("fmt,act_block", [("fp8", 128), ("dense", None)])
def test_streamk_other_formats(fmt: str, act_block) -> None:
    gen = torch.Generator().manual_seed(7)
    E, D, inter, k, T = 4, 256, 128, 2, 2
    ex = _experts(fmt, E, D, inter, gen, act_block)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(3, 64, 128))
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5


def test_streamk_bf16_compute() -> None:
    """bf16 activations: the gate / up results rounded to bf16 before the SwiGLU, as the twin."""
    gen = torch.Generator().manual_seed(11)
    E, D, inter, k, T = 6, 256, 256, 4, 1
    ex = _experts("fp4", E, D, inter, gen, 128)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _cfg(3))
    grouped = tri.moe_experts_with_config(x, ids, w, ex, 10.0,
                                          tri.MoeConfig(BM=16, BN_up=32, BN_down=64))
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2
    assert rel_err(y, grouped) < 1e-2


def test_streamk_config_checked() -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="streamk"):
            tri.MoeConfig(BM=16, BN_up=32, BN_down=64, streamk=bad)


@pytest.mark.parametrize("streamk", [0, 3])
def test_kchunk_layout_matches_rows(streamk: int) -> None:
    """K-chunk-major MXFP4 stacks (ExpertWeights.kchunk): the twin un-permutes them, the
    kernels (grouped and stream-K) read them in place; same results as the row-major stacks."""
    gen = torch.Generator().manual_seed(21 + streamk)
    E, D, inter, k, T = 6, 256, 256, 4, 2
    ex = _experts("fp4", E, D, inter, gen, 128)
    w1, w3, w2 = (ref.rows_kchunk(w, 64) for w in (ex.w1, ex.w3, ex.w2))
    s1, s3, s2 = (ref.rows_kchunk(s.view(torch.uint8), 4).view(E8M0)
                  for s in (ex.s1, ex.s3, ex.s2))
    assert torch.equal(ref.kchunk_rows(w1, 64), ex.w1)
    ch = ref.ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, kchunk=128)
    x = torch.randn(T, D, generator=gen)
    ids, w = _routing(T, E, k, gen)
    assert torch.equal(ref.moe_experts(x, ids, w, ch, 10.0), ref.moe_experts(x, ids, w, ex, 10.0))
    cfg = _cfg(streamk)
    y = tri.moe_experts_with_config(x, ids, w, ch, 10.0, cfg)
    assert torch.equal(y, tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg))
    with pytest.raises(ValueError, match="kchunk"):
        ref.ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, kchunk=48)
    with pytest.raises(ValueError, match="kchunk"):
        tri.dequant_experts(ch, "w1", torch.empty(E, inter, D))
