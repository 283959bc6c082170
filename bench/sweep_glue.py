"""Tile-plan sweep of the mHC ops and the expert activation prep at V4-Flash shapes (issue #5).

    PYTHONPATH=. python bench/sweep_glue.py --out sweep_glue.json        # H200, < 90 s
    PYTHONPATH=. python bench/sweep_glue.py --tiny                      # CPU smoke (interpreter)

Per (op, T) it times the default plan and candidate plans (CUDA-graph replays, median), checks
each candidate's outputs against the default's (x_new / y / prep rows bit for bit; the fp32
mixes post / comb by relative error) and prints a markdown table: T, op, plan, µs, the bytes
floor (bytes / 4.29 TB/s), ratio, same output; ``*`` marks the fastest plan with the same
output per (op, T).  Ops: ``hc_post_pre`` (D 4096, n 4, 24 mixes, fn fp32 [24, 16384]),
``hc_pre``, ``hc_post``, ``prep_up`` / ``prep_down`` (``_moe_prep_kernel``: E 256, top-6, MXFP4
experts, official numerics: act_block 128), and ``norm``: the mHC collapse before / after the
n = 4 rewrite (scalar Sinkhorn) and the sublayer input norm fused into it, against the old
collapse + ``rms_norm`` (:func:`sweep_norm`; e.g. ``--ops norm --tokens 1,64,8192``).  Candidates that fail to compile are skipped with
the reason; past ``--budget`` seconds the rest are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

if "--tiny" in sys.argv:            # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv4.ops import triton_mhc  # noqa: E402
from dsv4.ops import triton_moe as tm  # noqa: E402
from dsv4.ops.triton_moe_plan import moe_plan  # noqa: E402

BW = 4.29e12
EPS = (1e-6, 1e-6, 20)
P = triton_mhc.HcPlan
# Candidates besides the default: decode token counts (< triton_mhc.HC_PREFILL_T) and prefill.
# (Decode, T = 1: 16-, 32-, 64-column chunks give 256 / 128 / 64 D splits of ~1 program per
# SM; fewer splits also shorten the collapse's split-K sum.)
POST_PRE = {"decode": [P(16, 32, 4, 3, 2, "bf16x3"), P(16, 64, 4, 3, 2), P(16, 32, 4, 2, 4),
                       P(16, 16, 4, 3, 2, "bf16x3"), P(16, 64, 4, 3, 2, "bf16x3"),
                       P(16, 32, 2, 3, 2, "bf16x3")],
            "prefill": [P(64, 32, 4, 3, 2), P(64, 32, 4, 2, 2, "bf16x3"),
                        P(64, 32, 8, 3, 2, "bf16x3"), P(128, 32, 8, 2, 2, "bf16x3"),
                        P(64, 64, 8, 2, 2, "bf16x3"), P(32, 32, 4, 2, 4, "bf16x3"),
                        P(64, 32, 8, 2, 4, "bf16x3"), P(64, 16, 4, 3, 4, "bf16x3"),
                        # (fortieth session: the gates loaded once; ~1 wave of blocks)
                        P(64, 16, 4, 3, 2, "bf16x3"), P(64, 16, 4, 3, 4, "bf16x3", True),
                        P(64, 16, 4, 3, 1, "bf16x3", True), P(64, 16, 4, 3, 2, "bf16x3", True),
                        P(64, 16, 4, 2, 2, "bf16x3"), P(64, 16, 4, 2, 1, "bf16x3", True),
                        P(64, 16, 4, 3, 3, "bf16x3", True)]}
PRE = {"decode": [P(16, 32, 4, 3, 2, "bf16x3"), P(16, 64, 4, 3, 4)],
       "prefill": [P(64, 32, 4, 3, 2), P(128, 32, 8, 3, 2, "bf16x3"), P(64, 32, 8, 3, 2, "bf16x3"),
                   P(64, 64, 8, 2, 2, "bf16x3"), P(32, 32, 4, 3, 4, "bf16x3")]}
# From this many tokens up to HC_PREFILL_T the sweep tries the decode and the prefill candidates.
MID_T_MIN = 64
POST = [P(1, 256, 4, 3), P(1, 1024, 4, 3), P(1, 1024, 8, 3), P(1, 2048, 8, 3)]
# (The decode plans of BM 16 keep 16 rows: larger row counts clamp to BM.)
PREP = [tm.PrepPlan(16, 4), tm.PrepPlan(64, 4), tm.PrepPlan(64, 8), tm.PrepPlan(128, 4),
        tm.PrepPlan(128, 8), tm.PrepPlan(32, 2)]


def time_us(fn: Callable[[], Any], dev: str, reps: int) -> float:
    """Median µs per call: CUDA-graph replays (``bench/kernels.time_graph``, ~3 ms of calls per
    replay; ``reps`` is unused there); CPU: wall time of one call."""
    if dev != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from bench.kernels import time_graph
    return time_graph([fn])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def hc_inputs(T: int, n: int, D: int, dev: str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = (2 + n) * n

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=dev)

    return (r(T, D).bfloat16(), r(T, n, D).bfloat16(),
            torch.rand(T, n, generator=gen, device=dev) * 2,
            torch.rand(T, n, n, generator=gen, device=dev),
            r(rows, n * D) * (0.5 / D ** 0.5), torch.rand(3, generator=gen, device=dev) + 0.5,
            r(rows) * 0.5)


def compare_hc(got: tuple, want: tuple, bits: tuple[int, ...], soft: tuple[int, ...] = ()
               ) -> tuple[bool, str]:
    """Outputs at ``bits`` positions bit for bit (count of differing elements); at ``soft``
    (y: a bf16 rounding of gates that follow the mixes) the count of differing elements is
    reported and rel < 4e-3 required (other split / dot orders move the mixes by fp32
    rounding, which can flip a y element by one bf16 ulp); the rest (fp32 mixes) by relative
    error < 1e-5."""
    notes, same = [], True
    for i, (g, w) in enumerate(zip(got, want)):
        if i in bits or i in soft:
            diff = int((g.view(torch.int16) != w.view(torch.int16)).sum()) if g.dtype == \
                torch.bfloat16 else int((g != w).sum())
            notes.append(f"o{i} diff {diff}")
            same &= diff == 0 if i in bits else rel(g, w) < 4e-3
        else:
            e = rel(g, w)
            notes.append(f"o{i} rel {e:.1e}")
            same &= e < 1e-5
    return same, ", ".join(notes)


def sweep_hc(op: str, T: int, n: int, D: int, dev: str, reps: int, plans: list,
             deadline: float) -> list[dict]:
    out, x_res, post, comb, fn, scale, base = hc_inputs(T, n, D, dev, seed=T)
    bf = 2
    if op == "hc_post_pre":
        def call(p):
            return triton_mhc.hc_post_pre_with_plan(out, x_res, post, comb, fn, scale, base, *EPS,
                                            plan=p)
        nbytes = T * D * bf * 2 + T * n * D * bf * 3 + fn.numel() * 4
        bits, soft = (0,), (1,)
    elif op == "hc_pre":
        def call(p):
            return triton_mhc.hc_pre_with_plan(x_res, fn, scale, base, *EPS, plan=p)
        nbytes = T * n * D * bf * 2 + T * D * bf + fn.numel() * 4
        bits, soft = (), (0,)
    else:
        def call(p):
            return (triton_mhc.hc_post_with_plan(out, x_res, post, comb, plan=p),)
        nbytes = T * D * bf + T * n * D * bf * 2
        bits, soft = (0,), ()
    default = triton_mhc.pick_hc_plan({"hc_post_pre": "post_pre", "hc_pre": "pre", "hc_post": "post"}[op],
                              T, n, D, torch.bfloat16)
    ref = call(None)
    rows = []
    for p in [None] + [q for q in plans if q != default]:
        label = "default " + default.label() if p is None else p.label()
        row = dict(T=T, op=op, plan=label, floor_us=nbytes / BW * 1e6)
        if time.perf_counter() > deadline:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            got = call(p)
            row["same"], row["check"] = compare_hc(got, ref, bits, soft) if p else (True, "default")
            row["us"] = time_us(lambda p=p: call(p), dev, reps)
        except Exception as e:          # a plan that does not compile / launch: say why
            row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    return rows


def _old_collapse(x: torch.Tensor, mixes: tuple, scale: torch.Tensor, base: torch.Tensor,
                  head: bool) -> tuple[torch.Tensor, ...]:
    """The collapse as it ran before the n = 4 kernel (``_hc_collapse_kernel``: the Sinkhorn
    on a 4x4 tile with cross-thread sums, grid (T, D / 1024)) on the mixes' partials."""
    import triton
    _, part, sq, splits, njp = mixes
    T, n, D = x.shape
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    post = torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    BD = min(1024, triton.next_power_of_2(D))
    triton_mhc._hc_collapse_kernel[(T, triton.cdiv(D, BD))](
        x, part, sq, scale, base, y, y if head else post, y if head else comb, T, D, splits,
        *EPS[:2], ITERS=1 if head else EPS[2], N=n, NJP=njp, SP=triton.next_power_of_2(splits),
        BD=BD, HEAD=head, num_warps=4)
    return (y,) if head else (y, post, comb)


def _new_collapse(x: torch.Tensor, mixes: tuple, scale: torch.Tensor, base: torch.Tensor,
                  head: bool, w: torch.Tensor | None, fuse: bool | None) -> tuple[torch.Tensor, ...]:
    """The n = 4 collapse (``_collapse``: scalar Sinkhorn; with ``w`` the input norm, fused or
    not) on the mixes' partials."""
    xc, part, sq, splits, njp = mixes
    T, n, D = x.shape
    post = None if head else torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = None if head else torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    y = triton_mhc._collapse(xc, part, sq, splits, njp, scale, base, post, comb, *EPS[:2],
                             1 if head else EPS[2], w, None, fuse)
    return (y,) if head else (y, post, comb)


def sweep_norm(T: int, n: int, D: int, dev: str, deadline: float) -> list[dict]:
    """The collapse before / after the n = 4 rewrite, and the sublayer input norm fused into
    it (``norm_weight``) against collapse + ``rms_norm``; "old" is the previous code path
    (``_hc_collapse_kernel``, then the norm kernel).  Rows: the collapse kernel alone on the
    mixes' partials (``collapse``, ``collapse+norm``, ``head+norm``) and the whole ops
    (``hc_pre+norm``, ``hc_post_pre+norm``: mixes included).  "same": bit-identical to the
    first row of its op (the old path), else the count of differing bf16 elements with
    rel < 4e-3 (the new kernel compiles without FMA contraction: an fp32 rounding apart)."""
    from dsv4.ops import triton_norm
    out, x_res, post, comb, fn, scale, base = hc_inputs(T, n, D, dev, seed=T + 5)
    w = torch.rand(D, device=dev) + 0.5
    fh, sh, bh = fn[:n], scale[:1], base[:n]
    pre_mix = triton_mhc._hc_mix(x_res, fn, (2 + n) * n, "hc_pre", None)
    head_mix = triton_mhc._hc_mix(x_res, fh, n, "hc_head", None)
    norm = triton_norm.rms_norm
    bf = 2
    x_bytes = T * n * D * bf
    cases = {
        "collapse": (x_bytes + T * D * bf, [
            ("old", lambda: _old_collapse(x_res, pre_mix, scale, base, False)),
            ("new", lambda: _new_collapse(x_res, pre_mix, scale, base, False, None, None))]),
        "collapse+norm": (x_bytes + T * D * bf, [
            ("old + rms_norm", lambda: (lambda r: (norm(r[0], w, EPS[0]), *r[1:]))(
                _old_collapse(x_res, pre_mix, scale, base, False))),
            ("new + rms_norm", lambda: _new_collapse(x_res, pre_mix, scale, base, False, w,
                                                      False)),
            ("new fused", lambda: _new_collapse(x_res, pre_mix, scale, base, False, w, True))]),
        "head+norm": (x_bytes + T * D * bf, [
            ("old + rms_norm", lambda: (norm(_old_collapse(x_res, head_mix, sh, bh, True)[0],
                                             w, EPS[0]),)),
            ("new + rms_norm", lambda: _new_collapse(x_res, head_mix, sh, bh, True, w, False)),
            ("new fused", lambda: _new_collapse(x_res, head_mix, sh, bh, True, w, True))]),
        "hc_pre+norm": (x_bytes * 2 + T * D * bf + fn.numel() * 4, [
            ("old: mixes + old collapse + rms_norm", lambda: (lambda r: (
                norm(r[0], w, EPS[0]), *r[1:]))(_old_collapse(
                    x_res, triton_mhc._hc_mix(x_res, fn, (2 + n) * n, "hc_pre", None), scale,
                    base, False))),
            ("new + rms_norm", lambda: triton_mhc.hc_pre_with_plan(
                x_res, fn, scale, base, *EPS, None, w, None, False)),
            ("new fused", lambda: triton_mhc.hc_pre_with_plan(
                x_res, fn, scale, base, *EPS, None, w, None, True))]),
        "hc_post_pre+norm": (T * D * bf * 2 + x_bytes * 3 + fn.numel() * 4, [
            ("old: post+mixes, old collapse, rms_norm", lambda: _old_post_pre(
                out, x_res, post, comb, fn, scale, base, w)),
            ("new + rms_norm", lambda: triton_mhc.hc_post_pre_with_plan(
                out, x_res, post, comb, fn, scale, base, *EPS, None, w, None, False)[1:]),
            ("new fused", lambda: triton_mhc.hc_post_pre_with_plan(
                out, x_res, post, comb, fn, scale, base, *EPS, None, w, None, True)[1:])]),
    }
    rows = []
    for op, (nbytes, variants) in cases.items():
        ref = None
        for label, call in variants:
            row = dict(T=T, op=op, plan=label, floor_us=nbytes / BW * 1e6)
            if time.perf_counter() > deadline:
                rows.append({**row, "skipped": "time budget"})
                continue
            try:
                got = call()
                if ref is None:
                    ref, row["same"], row["check"] = got, True, "reference (old path)"
                else:
                    row["same"], row["check"] = compare_hc(got, ref, (), (0,))
                row["us"] = time_us(call, dev, 1)
            except Exception as e:
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
    return rows


def _old_post_pre(out, x_res, post, comb, fn, scale, base, w) -> tuple[torch.Tensor, ...]:
    """hc_post_pre as before: the post + mixes kernel, the old collapse, the norm kernel."""
    import triton

    from dsv4.ops import triton_norm
    T, n, D = x_res.shape
    rows = (2 + n) * n
    plan = triton_mhc.pick_hc_plan("post_pre", T, n, D, x_res.dtype)
    njp = max(16, triton.next_power_of_2(rows))
    tiles = triton.cdiv(T, plan.BT)
    d_per_split, splits = triton_mhc._splits(D, plan.BD, tiles, plan, x_res.device)
    x_new = torch.empty_like(x_res)
    part = torch.empty(splits, T, njp, dtype=torch.float32, device=x_res.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=x_res.device)
    triton_mhc._launch_mixes(triton_mhc._hc_post_mix_kernel, (tiles, splits),
                             (out, x_res, post, comb, fn, x_new, part, sq, T, D, d_per_split),
                             x_res.device, plan, plan.mix == "bf16x3", N=n, NJ=rows, NJP=njp,
                             BT=plan.BT, BD=plan.BD)
    y, p, c = _old_collapse(x_new, (x_new, part, sq, splits, njp), scale, base, False)
    return triton_norm.rms_norm(y, w, EPS[0]), p, c


def sweep_prep(T: int, dev: str, reps: int, dims: tuple[int, int, int, int],
               deadline: float) -> list[dict]:
    """The up prep (gather x into the plan's rows) and the down prep (act rows in place)."""
    E, D, inter, k = dims
    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, D, generator=gen, device=dev).bfloat16()
    ids = torch.rand(T, E, generator=gen, device=dev).topk(k, dim=-1).indices.to(torch.int32)
    cfg = tm.pick_moe_config(T * k, E, D, inter, 128)
    pairs, bexp = moe_plan(ids, E, cfg.BM)
    rows_total = bexp.shape[0] * cfg.BM
    act = torch.randn(rows_total, inter, generator=gen, device=dev).bfloat16()
    fmt = 1                                  # MXFP4: [even | odd] columns per K step
    cases = {"prep_up": (x, D, True, T * D * 2 + 2 * T * k * D * 2),
             "prep_down": (act, inter, False, 2 * T * k * inter * 2)}
    rows = []
    for op, (src, K, gather, nbytes) in cases.items():
        def call(p, src=src, K=K, gather=gather):
            dst = torch.zeros(rows_total, K, dtype=torch.bfloat16, device=dev)
            return tm.moe_prep(src, pairs, bexp, dst, T * k, E, k, gather, fmt, True, cfg.BM,
                               cfg.BK, p)
        ref = call(None)
        default = tm.pick_prep_plan(cfg.BM)
        for p in [None] + [q for q in PREP if min(q.rows, cfg.BM) != default.rows
                           or q.num_warps != default.num_warps]:
            pl = p or default
            label = f"{'default ' if p is None else ''}rows{min(pl.rows, cfg.BM)} w{pl.num_warps}"
            row = dict(T=T, op=op, plan=f"{label} (BM {cfg.BM})", floor_us=nbytes / BW * 1e6)
            if time.perf_counter() > deadline:
                rows.append({**row, "skipped": "time budget"})
                continue
            try:
                got = call(p)
                diff = int((got.view(torch.int16) != ref.view(torch.int16)).sum())
                row["same"], row["check"] = diff == 0, f"diff {diff}"
                row["us"] = time_us(lambda p=p: call(p), dev, reps)
            except Exception as e:
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown table; ``*`` on the fastest same-output plan per (op, T)."""
    best: dict[tuple, float] = {}
    for r in rows:
        if "us" in r and r.get("same"):
            key = (r["op"], r["T"])
            best[key] = min(best.get(key, float("inf")), r["us"])
    lines = ["| T | op | plan | µs | floor µs | ratio | same output |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "us" not in r:
            lines.append(f"| {r['T']} | {r['op']} | {r['plan']} | skipped | "
                         f"{r['floor_us']:.1f} | | {r.get('skipped', '')} |")
            continue
        mark = " *" if r.get("same") and r["us"] == best.get((r["op"], r["T"])) else ""
        lines.append(f"| {r['T']} | {r['op']} | {r['plan']}{mark} | {r['us']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['us'] / r['floor_us']:.1f} | "
                     f"{'yes' if r['same'] else 'NO'} ({r['check']}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run through the interpreter")
    ap.add_argument("--tokens", default=None, help="comma list of T (default 1,16,64,1024,8192)")
    ap.add_argument("--ops", default="hc_post_pre,hc_pre,hc_post,prep",
                    help="comma list of hc_post_pre, hc_pre, hc_post, prep, norm (the n = 4 "
                         "collapse old vs new, and its fused input norm; only when named)")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds before skipping the rest")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + a.budget
    if a.tiny:
        dev, n, D, reps = "cpu", 4, 64, 1
        tokens = [int(v) for v in (a.tokens or "1,19").split(",")]
        prep_dims = (8, 256, 128, 2)
        # A few candidates only: the interpreter is slow.
        post_pre = {"decode": POST_PRE["decode"][:1], "prefill": POST_PRE["prefill"][:1]}
        pre, post = {"decode": PRE["decode"][:1], "prefill": []}, POST[:1]
        PREP[:] = [tm.PrepPlan(8, 2)]
    else:
        if not torch.cuda.is_available():
            print("sweep_glue: needs a CUDA GPU (or --tiny for the CPU smoke run)")
            return 2
        dev, n, D, reps = "cuda", 4, 4096, 20
        tokens = [int(v) for v in (a.tokens or "1,16,64,1024,8192").split(",")]
        prep_dims = (256, 4096, 2048, 6)
        post_pre, pre, post = POST_PRE, PRE, POST
    ops = a.ops.split(",")
    rows: list[dict] = []
    for T in tokens:
        phase = "prefill" if T >= triton_mhc.HC_PREFILL_T else "decode"
        # Between decode and prefill sizes (a short prompt, a mixed step) both kinds compete.
        mid = MID_T_MIN <= T < triton_mhc.HC_PREFILL_T
        if "hc_post_pre" in ops:
            cands = post_pre["decode"] + post_pre["prefill"] if mid else post_pre[phase]
            rows += sweep_hc("hc_post_pre", T, n, D, dev, reps, cands, deadline)
        if "hc_pre" in ops:
            cands = pre["decode"] + pre["prefill"] if mid else pre[phase]
            rows += sweep_hc("hc_pre", T, n, D, dev, reps, cands, deadline)
        if "hc_post" in ops:
            rows += sweep_hc("hc_post", T, n, D, dev, reps, post, deadline)
        if "prep" in ops:
            rows += sweep_prep(T, dev, reps, prep_dims, deadline)
        if "norm" in ops:
            rows += sweep_norm(T, n, D, dev, deadline)
    print(table(rows))
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.1f} s"
          + ("  (interpreter: times are meaningless)" if a.tiny else ""))
    for r in rows:
        if "skipped" in r:
            print(f"skipped: T={r['T']} {r['op']} {r['plan']}: {r['skipped']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
