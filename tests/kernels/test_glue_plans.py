"""Tile plans of the mHC ops and of the expert activation prep (issue #5): every plan family the
sweep (bench/sweep_glue.py) tries gives the default plan's outputs (x_new and the prep rows bit
for bit, the fp32 mixes to fp32 rounding) and the twin's, in the Triton interpreter at tiny
shapes (``test_interp_*``, run in a child with TRITON_INTERPRET=1); bad plans are rejected; the
sweep's CPU smoke run works.

Tolerances as tests/kernels/interp/test_hc_fused.py: mixes 1e-5 (fp32 sums in another order),
y 4e-3 in bf16 (one rounding of gates that follow the mixes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
EPS = (1e-6, 1e-6, 20)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _hc_inputs(T: int, n: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    return (torch.randn(T, D, generator=gen).bfloat16(),
            torch.randn(T, n, D, generator=gen).bfloat16(),
            torch.rand(T, n, generator=gen) * 2, torch.rand(T, n, n, generator=gen),
            torch.randn(rows, n * D, generator=gen) * 0.1, torch.rand(3, generator=gen) + 0.5,
            torch.randn(rows, generator=gen) * 0.5)


def _post_chain(out: torch.Tensor, x_res: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    """x_new as the fused kernel forms it: post_k·out, then + comb[j, k]·x_res_j for j = 0..n-1
    in fp32 (separate roundings, as the interpreter does them), one bf16 rounding."""
    o, xr = out.float(), x_res.float()
    new = post[:, :, None] * o[:, None, :]
    for j in range(x_res.shape[1]):
        new = new + comb[:, j, :, None] * xr[:, j, None, :]
    return new.to(x_res.dtype)


def test_glue_plans_in_interpreter() -> None:
    """Runs this file's ``test_interp_*`` tests in a child with TRITON_INTERPRET=1."""
    if INTERP:
        pytest.skip("running inside the interpreter child")
    sys.path.insert(0, str(HERE))
    from interp_child import run_in_interpreter
    run_in_interpreter(__file__, keyword="interp_", min_passed=4)


# ------------------------------------------------------------------------ interpreter (child)
needs_interp = pytest.mark.skipif(not INTERP, reason="runs in the interpreter child")


def _sweep_plans():
    sys.path.insert(0, str(REPO / "bench"))
    import sweep_glue
    return sweep_glue


@needs_interp
@pytest.mark.parametrize("n", [4, 2])
def test_interp_hc_post_pre_plans(n: int) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_mhc
    sg = _sweep_plans()
    T, D = 19, 64
    args = _hc_inputs(T, n, D, seed=n)
    x0, y0, p0, c0 = triton_mhc.hc_post_pre_with_plan(*args, *EPS)
    # x_new: the plain bf16 rounding of the fp32 chain, bit for bit.
    assert torch.equal(x0.view(torch.int16), _post_chain(*args[:4]).view(torch.int16))
    y_r, p_r, c_r = ref.hc_pre(x0, *args[4:], *EPS)
    assert _rel(y0.float(), y_r.float()) < 4e-3 and _rel(p0, p_r) < 1e-5 and _rel(c0, c_r) < 1e-5
    plans = [triton_mhc.pick_hc_plan("post_pre", 8192, n, D, torch.bfloat16)]
    plans += sg.POST_PRE["decode"] + sg.POST_PRE["prefill"]
    # Keep the child fast: warps and stages do not change what the interpreter runs.
    distinct = {(p.BT, p.BD, p.per_sm, p.mix, p.gates_once): p for p in plans
                if p.BT <= 32 or p.BD <= 32}
    for plan in distinct.values():
        x, y, p, c = triton_mhc.hc_post_pre_with_plan(*args, *EPS, plan=plan)
        assert torch.equal(x.view(torch.int16), x0.view(torch.int16)), plan
        assert _rel(y.float(), y0.float()) < 4e-3, plan
        assert _rel(p, p0) < 1e-5 and _rel(c, c0) < 1e-5, plan


@needs_interp
def test_interp_hc_post_pre_composes_above_four_streams() -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_mhc
    args = _hc_inputs(3, 8, 16, seed=8)
    x, y, p, c = triton_mhc.hc_post_pre_with_plan(*args, *EPS)
    assert _rel(x.float(), ref.hc_post(*args[:4]).float()) < 4e-3
    y_r, p_r, c_r = ref.hc_pre(x, *args[4:], *EPS)
    assert _rel(p, p_r) < 1e-5 and _rel(c, c_r) < 1e-5 and _rel(y.float(), y_r.float()) < 4e-3


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_hc_pre_and_post_plans(dtype: torch.dtype) -> None:
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_mhc
    sg = _sweep_plans()
    out, x, post, comb, fn, scale, base = _hc_inputs(17, 4, 64, seed=5)
    x, out = x.to(dtype), out.to(dtype)
    y_r, p_r, c_r = ref.hc_pre(x, fn, scale, base, *EPS)
    plans = [None, triton_mhc.pick_hc_plan("pre", 8192, 4, 64, dtype)] + sg.PRE["decode"]
    plans += [p for p in sg.PRE["prefill"] if p.BT <= 64]
    for plan in plans:
        y, p, c = triton_mhc.hc_pre_with_plan(x, fn, scale, base, *EPS, plan=plan)
        tol = 4e-3 if dtype == torch.bfloat16 else 1e-5
        assert _rel(y.float(), y_r.float()) < tol, plan
        assert _rel(p, p_r) < 1e-5 and _rel(c, c_r) < 1e-5, plan
    h_r = ref.hc_head(x, fn[:4], scale[:1], base[:4], 1e-6, 1e-6)
    h = triton_mhc.hc_head_with_plan(x, fn[:4], scale[:1], base[:4], 1e-6, 1e-6,
                             plan=triton_mhc.pick_hc_plan("pre", 8192, 4, 64, dtype))
    assert _rel(h.float(), h_r.float()) < (4e-3 if dtype == torch.bfloat16 else 1e-5)
    new0 = triton_mhc.hc_post_with_plan(out, x, post, comb)
    for plan in sg.POST:
        got = triton_mhc.hc_post_with_plan(out, x, post, comb, plan=plan)
        assert torch.equal(got, new0), plan


@needs_interp
@pytest.mark.parametrize("gather", [True, False])
def test_interp_prep_plans(gather: bool) -> None:
    """Every prep plan writes the same rows: the gathered, fake-quantized rows split per K step
    into [even | odd] columns (the twin's fake_quant_fp8 on the source rows)."""
    from dsv4.formats import fake_quant_fp8
    from dsv4.ops import triton_moe as tm
    from dsv4.ops.triton_moe_plan import moe_plan
    gen = torch.Generator().manual_seed(1 + gather)
    T, E, k, K, BM, BK = 23, 4, 2, 256, 64, 128
    ids = torch.rand(T, E, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    pairs, bexp = moe_plan(ids, E, BM)
    rows_total = bexp.shape[0] * BM
    src = torch.randn(T if gather else rows_total, K, generator=gen).bfloat16()
    real = pairs < T * k
    src_row = (pairs.long() // k) if gather else torch.arange(rows_total)
    want = fake_quant_fp8(src[src_row[real]], BK)
    want = want.view(-1, K // BK, BK // 2, 2).transpose(-1, -2).reshape(-1, K)
    for plan in (None, tm.PrepPlan(16, 4), tm.PrepPlan(64, 8), tm.PrepPlan(128, 2),
                 tm.PrepPlan(8, 1)):
        dst = torch.zeros(rows_total, K, dtype=torch.bfloat16)
        tm.moe_prep(src, pairs, bexp, dst, T * k, E, k, gather, 1, True, BM, BK, plan)
        assert torch.equal(dst[real].view(torch.int16), want.view(torch.int16)), plan
        assert not dst[~real].any(), plan          # padding rows are left unwritten


# ------------------------------------------------------------------------------ host checks
def test_plans_reject_bad_values() -> None:
    pytest.importorskip("triton")
    from dsv4.ops import triton_mhc
    from dsv4.ops import triton_moe as tm
    for bad in (dict(BT=24, BD=32), dict(BT=16, BD=32, mix="tf32"),
                dict(BT=16, BD=32, num_stages=0), dict(BT=16, BD=32, num_warps=3)):
        with pytest.raises(ValueError, match="HcPlan"):
            triton_mhc.HcPlan(**bad)
    with pytest.raises(ValueError, match="PrepPlan"):
        tm.PrepPlan(rows=24)
    with pytest.raises(ValueError, match="op must be"):
        triton_mhc.pick_hc_plan("head", 1, 4, 64, torch.bfloat16)
    # Decode keeps the tile sizes the kernels had before plans existed, with the bf16x3 mixes
    # of prefill (the H200 sweep's best at every T).
    want = triton_mhc.HcPlan(16, 32, 4, 3, mix="bf16x3")
    assert triton_mhc.pick_hc_plan("post_pre", 1, 4, 4096, torch.bfloat16) == want
    assert triton_mhc.pick_hc_plan("pre", 64, 4, 4096, torch.bfloat16) == want
    assert triton_mhc.pick_hc_plan("post_pre", 8192, 4, 4096, torch.bfloat16) == triton_mhc.HcPlan(
        64, 16, 4, 3, per_sm=4, mix="bf16x3")
    assert triton_mhc.pick_hc_plan("post", 1, 4, 4096, torch.bfloat16) == triton_mhc.HcPlan(1, 512, 4, 3)
    # The fused post + mixes between decode and prefill sizes: decode tiles on 2 warps, then
    # the prefill plan (H100 sweep); the mixes alone keep the decode tiles there.
    mid = triton_mhc.HcPlan(16, 32, 2, 3, mix="bf16x3")
    assert triton_mhc.pick_hc_plan("post_pre", 63, 4, 4096, torch.bfloat16) == want
    assert triton_mhc.pick_hc_plan("post_pre", 64, 4, 4096, torch.bfloat16) == mid
    assert triton_mhc.pick_hc_plan("post_pre", 255, 4, 4096, torch.bfloat16) == mid
    assert triton_mhc.pick_hc_plan("post_pre", 256, 4, 4096, torch.bfloat16) == \
        triton_mhc.pick_hc_plan("post_pre", 8192, 4, 4096, torch.bfloat16)
    assert triton_mhc.pick_hc_plan("pre", 512, 4, 4096, torch.bfloat16) == want
    # fp32 streams never take the bf16 mix.
    assert triton_mhc.pick_hc_plan("post_pre", 8192, 4, 4096, torch.float32).mix == "fp32"


def test_wide_plan_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4_HC_WIDE_PLAN (A/B runs) sets the wide post + mixes plan's per_sm and gates_once,
    nothing else; a malformed value is a clear error."""
    from dsv4.ops import triton_mhc
    monkeypatch.setattr(triton_mhc, "_WIDE_PLAN_ENV", "1,g1")
    assert triton_mhc.pick_hc_plan("post_pre", 8192, 4, 4096, torch.bfloat16) == triton_mhc.HcPlan(
        64, 16, 4, 3, per_sm=1, mix="bf16x3", gates_once=True)
    assert not triton_mhc.pick_hc_plan("post_pre", 1, 4, 4096, torch.bfloat16).gates_once
    for bad in ("0", "x", "2,g2"):
        monkeypatch.setattr(triton_mhc, "_WIDE_PLAN_ENV", bad)
        with pytest.raises(ValueError, match="DSV4_HC_WIDE_PLAN"):
            triton_mhc.pick_hc_plan("post_pre", 8192, 4, 4096, torch.bfloat16)


def test_sweep_tiny_smoke(tmp_path: Path) -> None:
    """bench/sweep_glue.py --tiny: the CPU interpreter run produces a table and JSON rows whose
    candidates agree with the default."""
    if INTERP:
        pytest.skip("spawns its own interpreter child")
    pytest.importorskip("triton")
    import json
    out = tmp_path / "sweep.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "sweep_glue.py"), "--tiny",
                           "--tokens", "19", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| T | op | plan |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"hc_post_pre", "hc_pre", "hc_post", "prep_up",
                                       "prep_down"}
    assert all(r.get("same") for r in rows), [r for r in rows if not r.get("same")]
    assert sum(1 for r in rows if not r["plan"].startswith("default")) >= 3
