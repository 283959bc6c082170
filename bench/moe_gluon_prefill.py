"""The prefill expert GEMMs on FP8 codes: Triton (``_fp8mma_up_kernel`` /
``_fp8mma_down_kernel`` with ``PREDECODED``, the shipped plan) against the Gluon kernels of
:mod:`dsv4.ops.gluon_moe_prefill` (TMA ring; plain, lagged or warp-specialized) on the same
prepped inputs: V4-Flash widths (D 4096, I 2048, top-6), random MXFP4 stacks re-encoded to
kept codes, random routing.

    PYTHONPATH=. python bench/moe_gluon_prefill.py [--tokens 8192,32768] [--experts 256]
        [--plans up:BN:stages[:lag|:ws],...] [--out f.json]

Printed per token count: each GEMM's µs and TFLOP/s for Triton and for every Gluon plan, the
whole expert call (``moe_experts_fp8mma`` on kept codes and on the per-call re-encoding) with
``DSV4_FP8MMA_GLUON`` off and on (the default plans), and whether the Gluon output has the
Triton kernels' bits (act rows of the plan for up, y rows of the pairs for down, the call's
output; the relative difference where not).  GPU (sm_90) only: Gluon has no interpreter.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_decode import routing  # noqa: E402
from moe_prefill_fp8 import bench_setup, prepped, rel_diff, time_us  # noqa: E402

from dsv4.ops import gluon_moe_mxfp4 as mx  # noqa: E402
from dsv4.ops import gluon_moe_prefill as gp  # noqa: E402
from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402
from dsv4.ops.triton_moe import tile_grid  # noqa: E402

LIMIT = 10.0
# The warp-specialized plans last (a hang there would cut the run short).
DEFAULT_PLANS = ("up:32:4:lag,up:32:4,up:64:4,up:64:6,down:64:4:lag,down:64:4,down:128:4,"
                 "down:128:6,up:128:4:ws,up:128:3:ws,up:64:6:ws,down:256:4:ws,down:128:4:ws,"
                 "down:128:6:ws")


def parse_plans(text: str) -> list[tuple[str, gp.GluonGemmPlan]]:
    """``gemm:BN:stages[:lag|:ws]`` items -> (gemm, plan): 64-row blocks (the Triton plan's),
    4 warps; ``lag``: the rescale one step behind; ``ws``: warp-specialized (two consumer
    warpgroups of BN / 2 columns)."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        mode = parts[3] if len(parts) == 4 else ""
        if parts[0] not in ("up", "down") or len(parts) not in (3, 4) or \
                mode not in ("", "lag", "ws"):
            raise SystemExit(f"moe_gluon_prefill: bad plan {item!r} "
                             f"(up|down:BN:stages[:lag|:ws])")
        out.append((parts[0], gp.GluonGemmPlan(BM=64, BN=int(parts[1]), stages=int(parts[2]),
                                               warps=4, lag=mode == "lag", ws=mode == "ws")))
    return out


def triton_up(pl: dict[str, Any], codes: f8.Fp8Codes, wts: torch.Tensor, act: torch.Tensor,
              cfg: f8.MoeFp8Config, ab: int) -> None:
    E, inter, D = codes.q1.shape
    grid, first = tile_grid(pl["nb"], triton.cdiv(inter, cfg.BN_up), n_first=True)
    f8._fp8mma_up_kernel[grid](
        pl["xq"], pl["xs"], codes.q1, codes.q3, codes.f1, codes.f3, pl["pairs"],
        pl["block_expert"], wts, act, pl["P"], inter, D, 0, E, pl["xq"].stride(0),
        pl["xs"].stride(0), act.stride(0), codes.q1.stride(0), codes.q1.stride(1),
        codes.f1.stride(0), codes.f1.stride(1), LIMIT, HAS_LIMIT=True, ASM_DECODE=True, AB=ab,
        KS=codes.ks, BM=cfg.BM, BN=cfg.BN_up, N_FIRST=first, num_warps=cfg.warps_up,
        num_stages=cfg.stages, PREDECODED=True)


def triton_down(pl: dict[str, Any], codes: f8.Fp8Codes, aq: torch.Tensor, as_: torch.Tensor,
                y: torch.Tensor, cfg: f8.MoeFp8Config, ab: int) -> None:
    E, D, inter = codes.q2.shape
    grid, first = tile_grid(pl["nb"], triton.cdiv(D, cfg.BN_down), n_first=True)
    f8._fp8mma_down_kernel[grid](
        aq, as_, codes.q2, codes.f2, pl["pairs"], pl["block_expert"], y, pl["P"], D, inter, 0,
        E, aq.stride(0), as_.stride(0), y.stride(0), codes.q2.stride(0), codes.q2.stride(1),
        codes.f2.stride(0), codes.f2.stride(1), ASM_DECODE=True, AB=ab, KS=codes.ks,
        BM=cfg.BM, BN=cfg.BN_down, N_FIRST=first, num_warps=cfg.warps_down,
        num_stages=cfg.stages, PREDECODED=True)


def compare(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> str:
    """'bits' when the rows ``rows`` are bit-equal, else the relative difference (+ NaN note)."""
    g, w = got[rows], want[rows]
    if torch.equal(g.view(torch.int16), w.view(torch.int16)):
        return "bits"
    note = "" if torch.isfinite(g).all() else " (not finite)"
    return f"{rel_diff(g.float(), w.float()):.2e}{note}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not gp.HAVE_GLUON:
        raise SystemExit("moe_gluon_prefill: this triton has no Gluon")
    shape, device, tokens, gen, ex = bench_setup(args, "moe_gluon_prefill", "8192,32768", "",
                                                 args.experts)
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    codes = f8.encode_fp8_codes(ex)
    if codes is None:
        raise SystemExit("moe_gluon_prefill: the random stacks do not take the FP8-MMA path")
    ab = 128
    cfg = f8.PLAN_PREDECODED
    plans = parse_plans(args.plans)
    rows_out: list[dict[str, Any]] = []
    print(f"{E} experts, D {D}, I {inter}, top-{k}; Triton plan {cfg}; µs (TFLOP/s)")
    print("| tokens | GEMM | kernel | µs | TFLOP/s | output |")
    print("|---|---|---|---|---|---|")
    for T in tokens:
        x = torch.randn(T, D, generator=gen, device=device).to(torch.bfloat16)
        ids, w = routing(T, E, k, gen, device)
        wts = w.reshape(-1).float().contiguous()
        pl = prepped(x, ids, E, cfg.BM, ab)
        rows = (pl["pairs"] < pl["P"]).nonzero().squeeze(1)
        nrows = pl["nb"] * cfg.BM
        act_t = torch.zeros(nrows, inter, dtype=torch.bfloat16, device=device)
        triton_up(pl, codes, wts, act_t, cfg, ab)
        aq = torch.zeros(nrows, inter, dtype=torch.float8_e4m3fn, device=device)
        as_ = torch.zeros(nrows, inter // ab, dtype=torch.float32, device=device)
        f8._fp8_prep_kernel[(pl["nb"], inter // ab)](
            act_t, pl["pairs"], pl["block_expert"], aq, as_, pl["P"], E, k, act_t.stride(0),
            aq.stride(0), as_.stride(0), GATHER=False, BM=cfg.BM, AB=ab, num_warps=4)
        y_t = torch.zeros(pl["P"], D, dtype=torch.bfloat16, device=device)
        triton_down(pl, codes, aq, as_, y_t, cfg, ab)
        flops_up = 2 * 2 * pl["P"] * D * inter
        flops_down = 2 * pl["P"] * D * inter

        def row(gemm: str, kernel: str, us: float, flops: int, out: str) -> None:
            rows_out.append({"tokens": T, "gemm": gemm, "kernel": kernel, "us": us,
                             "tflops": flops / us / 1e6, "output": out})
            print(f"| {T} | {gemm} | {kernel} | {us:.1f} | {flops / us / 1e6:.0f} | {out} |",
                  flush=True)

        row("up", "triton", time_us(lambda: triton_up(pl, codes, wts, act_t, cfg, ab), device),
            flops_up, "reference")
        row("down", "triton", time_us(lambda: triton_down(pl, codes, aq, as_, y_t, cfg, ab),
                                      device), flops_down, "reference")
        # The whole expert call with the default Gluon plans (DSV4_FP8MMA_GLUON=0 / 1).
        for mode, exm in (("call, kept codes", replace(ex, fp8_codes=codes)),
                          ("call, re-encoded", ex)):
            outs = {}
            for on in (False, True):
                # The re-encoded call, not the GEMMs on the MXFP4 stacks (DSV4_FP8MMA_MX).
                saved = gp.GLUON_PREFILL, mx.MX_PREFILL
                gp.GLUON_PREFILL, mx.MX_PREFILL = "1" if on else "0", False
                try:
                    outs[on] = f8.moe_experts_fp8mma(x, ids, w, exm, LIMIT, predecode=True)
                    us = time_us(lambda: f8.moe_experts_fp8mma(x, ids, w, exm, LIMIT,
                                                               predecode=True), device)
                finally:
                    gp.GLUON_PREFILL, mx.MX_PREFILL = saved
                out = "reference" if not on else compare(outs[True], outs[False],
                                                         torch.arange(T, device=device))
                row(mode, "gluon" if on else "triton", us, flops_up + flops_down, out)
        valid_pairs = pl["pairs"][rows].long()
        for gemm, plan in plans:
            name = (f"gluon BN{plan.BN} s{plan.stages}"
                    f"{' lag' if plan.lag else ''}{' ws' if plan.ws else ''}")
            try:
                if gemm == "up":
                    act_g = torch.full_like(act_t, float("nan"))
                    fn = lambda: gp.gemm_up(pl["xq"], pl["xs"], codes.q1, codes.q3, codes.f1,
                                            codes.f3, pl["pairs"], pl["block_expert"], wts,
                                            act_g, pl["P"], 0, E, LIMIT, ab, codes.ks, plan)
                    fn()
                    torch.cuda.synchronize()
                    out = compare(act_g, act_t, rows)
                    row("up", name, time_us(fn, device), flops_up, out)
                else:
                    y_g = torch.full_like(y_t, float("nan"))
                    fn = lambda: gp.gemm_down(aq, as_, codes.q2, codes.f2, pl["pairs"],
                                              pl["block_expert"], y_g, pl["P"], 0, E, ab,
                                              codes.ks, plan)
                    fn()
                    torch.cuda.synchronize()
                    out = compare(y_g, y_t, valid_pairs)
                    row("down", name, time_us(fn, device), flops_down, out)
            except Exception as e:  # one failing plan must not hide the others' numbers
                msg = str(e).splitlines()[0][:120] if str(e) else ""
                print(f"| {T} | {gemm} | {name} | failed: {type(e).__name__}: {msg} | | |",
                      flush=True)
    result = {"shape": shape, "rows": rows_out}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry (see the module docstring); returns the results."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--experts", type=int, default=0, help="routed experts (default 256)")
    ap.add_argument("--plans", default=DEFAULT_PLANS,
                    help="Gluon plans, comma-separated gemm:BN:stages[:lag|:ws]")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
