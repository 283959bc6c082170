"""The MXFP4 expert GEMMs under the tile plans bench/moe_decode.py sweeps (BN 32/64 tiles, 128-row
blocks), official numerics at every act_block, every code / scale / row magnitude, the split-K
plans (MXFP4 / FP8 / dense stacks: the twin, counters reset, bit-reproducible, counter growth),
and the bench itself (--dry-run plan list, --tiny --sweep smoke run), in the Triton interpreter at
tiny shapes.

Run with TRITON_INTERPRET=1 (tests/kernels/test_interpreter.py does that in a child process).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
import triton

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by conftest
    pytest.skip("needs TRITON_INTERPRET=1", allow_module_level=True)

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_dense as td  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402
from interp_helpers import rel_err  # noqa: E402

E8M0 = torch.float8_e8m0fnu
BENCH = Path(__file__).resolve().parents[3] / "bench" / "moe_decode.py"


def _bench() -> ModuleType:
    """bench/moe_decode.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("moe_decode_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def _run(x, ids, w, ex, bm: int = 16, bn_up: int = 64, bn_down: int = 64) -> torch.Tensor:
    cfg = tri.MoeConfig(BM=bm, BN_up=bn_up, BN_down=bn_down)
    return tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)


# The sweep's tile shapes that tests/kernels/interp/test_moe.py does not force (it covers the
# defaults 16/64/128, 16/128/128, 32/128/128, 64/128/128); several N tiles per width.
@pytest.mark.parametrize("T,plan,D", [(1, (16, 64, 64), 256), (7, (16, 32, 64), 128),
                                      (30, (16, 32, 64), 256), (40, (128, 128, 128), 128)])
def test_sweep_tile_plans_match_twin_fp32(T: int, plan, D: int) -> None:
    """fp32 compute, official act quant: the same exact products summed in another fp32 order
    (rel ~1e-7), with skipped picks (-1, ids of other shards)."""
    gen = torch.Generator().manual_seed(T + plan[1])
    E, inter, k = 6, 128, 3
    ex = _fp4_experts(E, D, inter, gen, 128)
    x = torch.randn(T, D, generator=gen) * 2
    ids, w = _routing(T, E, k, gen)
    if T > 1:
        ids[0, 1] = -1
        ids[T - 1, 0] = E + 2
    y = _run(x, ids, w, ex, *plan)
    assert y.shape == (T, D) and torch.isfinite(y).all()
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5


@pytest.mark.parametrize("act_block", [32, 64, 128])
def test_bf16_official_block_sizes(act_block: int) -> None:
    """bf16 compute with FP8 activations per act_block (BK follows it: 1, 2 or 4 MXFP4 scale
    groups per K step)."""
    gen = torch.Generator().manual_seed(act_block)
    E, D, inter, k, T = 4, 128, 128, 2, 9
    ex = _fp4_experts(E, D, inter, gen, act_block)
    x = (torch.randn(T, D, generator=gen) * 3).to(torch.bfloat16)
    ids, w = _routing(T, E, k, gen)
    y = _run(x, ids, w, ex)
    assert torch.isfinite(y).all()
    # bf16 intermediates: a one-ulp flip of one activation moves the output by ~4e-3 rel.
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-2


def test_every_code_scale_and_row_magnitude() -> None:
    """All 256 byte values, scales 2^-27..2^12, rows of magnitude 1e-3 .. 1e3 (activation
    exponents -20..+2), one activation block with a much smaller amax than its row."""
    gen = torch.Generator().manual_seed(0)
    E, D, inter = 1, 512, 128
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    w1 = codes.repeat(inter, 1).view(1, inter, D // 2)
    s1 = torch.randint(100, 140, (1, inter, D // 32), generator=gen).to(torch.uint8).view(E8M0)
    base = _fp4_experts(E, D, inter, gen, 128)
    ex = ref.ExpertWeights(w1, w1.roll(1, dims=2), base.w2, 128, "fp4", s1, s1.roll(3, dims=2),
                           base.s2)
    x = torch.randn(6, D, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    x[2, 100:200] *= 1e-4
    ids = torch.zeros(6, 1, dtype=torch.int64)
    w = torch.ones(6, 1)
    cfg = tri.MoeConfig(BM=16, BN_up=64, BN_down=128)
    y = tri.moe_experts_with_config(x, ids, w, ex, 0.0, cfg)
    y_ref = ref.moe_experts(x, ids, w, ex, 0.0)
    for t in range(6):   # per row: a global norm would hide the small rows
        assert rel_err(y[t], y_ref[t]) < 1e-5, t


def test_moe_config_validation() -> None:
    with pytest.raises(ValueError, match="BN_up"):
        tri.MoeConfig(16, 48, 64)
    with pytest.raises(ValueError, match="BM"):
        tri.MoeConfig(8, 64, 64)
    with pytest.raises(ValueError, match="BN_down"):
        tri.MoeConfig(16, 64, 96)
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="split_up"):
            tri.MoeConfig(16, 64, 64, split_up=bad)
        with pytest.raises(ValueError, match="split_down"):
            tri.MoeConfig(16, 64, 64, split_down=bad)
    assert tri.MoeConfig(16, 64, 64, split_up=3, split_down=8).split_down == 8


# ------------------------------------------------------------------------------ split-K
# Widths with 5 K steps of 32 for both GEMMs (D = I = 160): splits 2, 3, 4 all leave a ragged
# share (2+3, 1+2+2, 1+1+1+2); 3 N tiles of 64, the last one partial.
SPLIT_E, SPLIT_D, SPLIT_I, SPLIT_K = 6, 160, 160, 2


def _split_experts(fmt: str, gen: torch.Generator, dtype: torch.dtype) -> ref.ExpertWeights:
    """MXFP4 / FP8 (block 32) / dense stacks at the split-K widths; official numerics (act
    block 32) for bf16 compute, none for fp32."""
    E, D, inter = SPLIT_E, SPLIT_D, SPLIT_I
    act = 32 if dtype == torch.bfloat16 else None
    if fmt == "fp4":
        return _fp4_experts(E, D, inter, gen, act)
    mats = [(inter, D), (inter, D), (D, inter)]
    if fmt == "fp8":
        ws = [(torch.randn(E, n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
              for n, k in mats]
        ss = [torch.randint(116, 121, (E, n // 32, k // 32), generator=gen).to(torch.uint8)
              .view(E8M0) for n, k in mats]
        return ref.ExpertWeights(*ws, act, "fp8", *ss, 32)
    ws = [(torch.randn(E, n, k, generator=gen) * k ** -0.5).to(dtype) for n, k in mats]
    return ref.ExpertWeights(*ws, act)


def _split_call(T: int, gen: torch.Generator, dtype: torch.dtype, skip: bool = True):
    """Inputs of one call; with ``skip`` (T > 1) two picks of other shards (-1, E + 1)."""
    x = (torch.randn(T, SPLIT_D, generator=gen) * 2).to(dtype)
    ids, w = _routing(T, SPLIT_E, SPLIT_K, gen)
    if skip and T > 1:
        ids[0, 1] = -1
        ids[T - 1, 0] = SPLIT_E + 1
    return x, ids, w


def _split_cfg(split_up: int, split_down: int) -> tri.MoeConfig:
    return tri.MoeConfig(16, 64, 64, split_up=split_up, split_down=split_down)


def _counters_clean() -> bool:
    return all(not bool(b.any()) for b in td._splitk_counter_cache.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp4", "fp8", "dense"])
def test_split_k_matches_twin(fmt: str, dtype: torch.dtype) -> None:
    """Split plans (up/down splits 2/4 at one token, 3/2 at three with skipped picks) against
    the twin, with the plan bounds (fp32 1e-5: the same products summed in another fp32 order;
    bf16 1e-2: a rounded intermediate may flip); unused static blocks in both calls; the
    arrival counters all back to 0."""
    gen = torch.Generator().manual_seed(len(fmt) * 7 + dtype.itemsize)
    ex = _split_experts(fmt, gen, dtype)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    for T, split_up, split_down in ((1, 2, 4), (3, 3, 2)):
        x, ids, w = _split_call(T, gen, dtype)
        _, bexp = tri.moe_plan(ids, SPLIT_E, 16)
        assert bool((bexp >= SPLIT_E).any()), "the plan has no unused block: nothing tested"
        y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _split_cfg(split_up, split_down))
        assert y.shape == (T, SPLIT_D) and torch.isfinite(y).all()
        assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < bound, (T, split_up)
        assert _counters_clean()


def test_split_k_close_to_unsplit_and_bit_reproducible() -> None:
    """fp32, MXFP4, splits 4/3: equal to the unsplit plan to fp32 rounding (not bit-equal in
    general), and bit-identical over two identical calls; a following call on other inputs is
    right too (the first left its counters at 0)."""
    gen = torch.Generator().manual_seed(41)
    ex = _split_experts("fp4", gen, torch.float32)
    x, ids, w = _split_call(3, gen, torch.float32)
    cfg = _split_cfg(4, 3)
    y1 = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    y2 = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    assert torch.equal(y1, y2)
    unsplit = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _split_cfg(1, 1))
    assert rel_err(y1, unsplit) < 1e-6
    x2, ids2, w2 = _split_call(1, gen, torch.float32)
    y3 = tri.moe_experts_with_config(x2, ids2, w2, ex, 10.0, cfg)
    assert rel_err(y3, ref.moe_experts(x2, ids2, w2, ex, 10.0)) < 1e-5
    assert _counters_clean()


def test_split_k_counter_buffer_grows(monkeypatch) -> None:
    """A fresh, minimal counter buffer sized by the first call (one token: 3 blocks × 3 tiles)
    grows for a call with more tiles (three tokens, 16-wide tiles); the old buffer is kept (a
    captured graph may still point at it); both calls match the twin; all counters end at 0."""
    monkeypatch.setattr(td, "_splitk_counter_cache", {})
    monkeypatch.setattr(td, "_splitk_retired", [])
    monkeypatch.setattr(td, "_SPLITK_MIN_COUNTERS", 1)
    gen = torch.Generator().manual_seed(43)
    ex = _split_experts("dense", gen, torch.float32)
    x, ids, w = _split_call(1, gen, torch.float32, skip=False)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, _split_cfg(2, 2))
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5
    (first,) = td._splitk_counter_cache.values()
    nb = tri.moe_plan(ids, SPLIT_E, 16)[1].numel()
    assert first.numel() == triton.next_power_of_2(nb * -(-SPLIT_D // 64))
    x, ids, w = _split_call(3, gen, torch.float32)
    cfg = tri.MoeConfig(16, 16, 32, split_up=3, split_down=2)
    y = tri.moe_experts_with_config(x, ids, w, ex, 10.0, cfg)
    assert rel_err(y, ref.moe_experts(x, ids, w, ex, 10.0)) < 1e-5
    (grown,) = td._splitk_counter_cache.values()
    nb = tri.moe_plan(ids, SPLIT_E, 16)[1].numel()
    assert grown.numel() >= nb * -(-SPLIT_I // 16) > first.numel()
    assert td._splitk_retired == [first]
    assert _counters_clean() and not bool(first.any())


def test_pick_moe_config_split_rule() -> None:
    """Splits only for 16-row blocks whose programs are few (V4-Flash: one token up 4 / down 4
    on 64-wide up tiles, the H200 sweep's best; up 8 on the 128-wide tiles of UP_PREP_ACT),
    powers of two <= 8, each split keeping >= 512 of K; none at tiny widths (too few K steps)
    nor from 8 tokens on."""
    D, inter = 4096, 2048
    one = tri.pick_moe_config(6, 256, D, inter, 128)
    want = (16, 128, 128, 8, 4) if tri.UP_PREP_ACT else (16, 64, 128, 4, 4)
    assert (one.BM, one.BN_up, one.BN_down, one.split_up, one.split_down) == want
    for T in (1, 2, 3, 4, 8, 16, 64, 256, 2048, 8192):
        cfg = tri.pick_moe_config(6 * T, 256, D, inter, 128)
        for split, k in ((cfg.split_up, D), (cfg.split_down, inter)):
            assert split in (1, 2, 4, 8) and (split == 1 or k // split >= 512), (T, cfg)
        if T >= 8:
            assert cfg.split_up == cfg.split_down == 1, (T, cfg)
        else:
            active = min(256, 6 * T)
            assert cfg.split_up * active * (inter // cfg.BN_up) >= 2 * 132, (T, cfg)
    v41 = tri.pick_moe_config(6, 384, 5120, 2304, 32)      # BK 32: the same K lengths rule
    assert (v41.split_up, v41.split_down) == (4, 4)
    tiny = tri.pick_moe_config(3, 8, 128, 64, 128)
    assert tiny.split_up == tiny.split_down == 1


def test_bench_sweep_plans_and_dry_run(capsys) -> None:
    """The sweep at V4-Flash widths: the default plan first, then distinct alternatives of its
    regime (BM 16 up to 256 tokens, BM 16-128 with 128-wide tiles beyond), about 30 plans in all; up to
    SPLIT_SWEEP_MAX_TOKENS tokens the up and the down K splits 1/2/4/8 on the default tiles."""
    mod = _bench()
    D, inter = mod.FLASH["D"], mod.FLASH["I"]
    for T in (1, 16, 17, 256, 257, 8192):
        base = tri.pick_moe_config(T * 6, 256, D, inter, 128)
        plans = mod.sweep_plans(T, base, D, inter)
        assert plans[0] == base and len(plans) == len(set(map(mod.plan_name, plans))) >= 5
        small = T <= mod.SMALL_MAX_TOKENS
        assert all(p.BM == 16 for p in plans[1:]) if small else \
            any(p.BM > 16 for p in plans[1:]), T
        assert all(p.BM in (16, 32, 64, 128) and p.BN_up == p.BN_down == 128
                   for p in plans[1:] if not small)
        split = [p for p in plans if (p.split_up, p.split_down) != (1, 1)]
        if T <= mod.SPLIT_SWEEP_MAX_TOKENS:
            ups = {p.split_up for p in plans if (p.BN_up, p.split_down) ==
                   (base.BN_up, base.split_down) and p.warps_up == base.warps_up}
            downs = {p.split_down for p in plans if (p.BN_down, p.split_up) ==
                     (base.BN_down, base.split_up) and p.warps_up == base.warps_up}
            assert ups >= set(mod.SPLITS) and downs >= set(mod.SPLITS), T
            assert all((p.BN_up, p.BN_down, p.warps_up) == (base.BN_up, base.BN_down,
                                                            base.warps_up) for p in split)
        else:
            assert split == [], T
        if small:   # the decode pipeline depths on the default tiles
            assert {p.stages for p in plans} >= {base.stages, *mod.DECODE_STAGES}, T
    with pytest.raises(ValueError, match="token count"):
        mod.sweep_plans(0, base, D, inter)
    out = mod.main(["--dry-run", "--sweep"])
    assert sorted(out["plans"]) == [1, 16, 64, 256, 8192]
    assert 22 <= out["distinct"] <= 40
    one = tri.pick_moe_config(6, 256, D, inter, 128)   # the default splits' neighbours swept
    assert any(f"split {one.split_up}/2" in name for name in out["plans"][1])
    assert f"{out['distinct']} distinct plans" in capsys.readouterr().out
    # Without --sweep only the default plan per token count; tiles wider than I are dropped.
    plain = mod.main(["--dry-run", "--tokens", "1,8192"])
    assert [len(v) for v in plain["plans"].values()] == [1, 1]
    narrow = mod.sweep_plans(1, tri.MoeConfig(16, 32, 64), 64, 32)
    assert all(p.BN_up <= 32 and p.BN_down <= 64 for p in narrow)
    with pytest.raises(SystemExit):
        mod.main(["--dry-run", "--tokens", "1,x"])


def test_bench_moe_decode_tiny_sweep_runs_end_to_end(tmp_path) -> None:
    """bench/moe_decode.py --tiny --sweep (what the GPU session runs at V4-Flash shapes): every
    plan finite and matching the twin, one best plan per token count in the JSON, the routing
    plan kernel equal to its twin."""
    mod = _bench()
    path = tmp_path / "moe.json"
    out = mod.main(["--tiny", "--sweep", "--tokens", "2", "--out", str(path)])
    rows = out["rows"]
    assert len(rows) == mod.TINY_SWEEP_PLANS
    assert [r["default"] for r in rows] == [True] + [False] * (len(rows) - 1)
    # The split plans come right after the default one: the smoke run takes a split-K plan.
    assert rows[1]["plan"]["split_up"] > 1
    for r in rows:
        assert "error" not in r, r
        assert r["finite"] and r["rel_twin"] < 1e-2 and r["us"] > 0 and r["ratio"] > 0
    (best,) = out["best"]
    assert best["us"] == min(r["us"] for r in rows) and best["T"] == 2
    assert all(p["same"] for p in out["plan"])
    saved = json.loads(path.read_text())
    assert saved["best"][0]["name"] == best["name"] and len(saved["rows"]) == len(rows)
