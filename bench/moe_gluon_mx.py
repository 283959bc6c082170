"""The prefill expert GEMMs straight on the MXFP4 stacks (:mod:`dsv4.ops.gluon_moe_mxfp4`, the
codes decoded in registers) against the Triton GEMMs on kept FP8 codes and against the whole
expert call with and without the per-call re-encoding: V4-Flash widths (D 4096, I 2048,
top-6), random K-chunk-major MXFP4 stacks, random routing.

    PYTHONPATH=. python bench/moe_gluon_mx.py [--tokens 8192,32768] [--experts 256]
        [--plans up|down:BM:warps:mt:stages[:dec|:pdec[N]],...] [--out f.json]

Printed per token count: each GEMM's µs and TFLOP/s (Triton on kept codes, then every plan of
the MXFP4 kernels, their output against Triton's: 'bits' or the relative difference), then the
whole call (``moe_experts_fp8mma``) on kept codes, re-encoded, and on the stacks with
``DSV4_FP8MMA_MX`` (its output against the re-encoded call's), and on the bf16-MMA kernels (what
calls below ``fp8mma_applies``' threshold run).  GPU (sm_90) only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_decode import routing  # noqa: E402
from moe_gluon_prefill import compare, triton_down, triton_up  # noqa: E402
from moe_prefill_fp8 import bench_setup, prepped, time_us  # noqa: E402

from dsv4.ops import gluon_moe_mxfp4 as mx  # noqa: E402
from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402
from dsv4.ops.triton_moe import _weight_args  # noqa: E402

LIMIT = 10.0
DEFAULT_PLANS = ("up:64:4:1:3,up:128:4:1:3:dec,up:128:4:1:4:dec,up:128:4:1:4:pdec,"
                 "up:128:4:1:4:pdec1,up:128:4:1:4:pdec2,up:128:4:1:3:pdec2,down:64:4:1:3,"
                 "down:128:4:1:3,down:128:4:1:4,down:128:4:1:3:dec,down:256:4:1:3:dec,"
                 "down:128:4:1:4:pdec1,down:128:4:1:4:pdec2,down:128:4:1:6:pdec2,"
                 "down:128:4:1:5:pdec4,down:256:4:1:3:pdec1")


def parse_plans(text: str) -> list[tuple[str, mx.MxPlan]]:
    """``gemm:BM:warps:mt:stages[:dec|:pdec[N]]`` items -> (gemm, plan) (the plan as
    :func:`dsv4.ops.gluon_moe_mxfp4.parse_plan` reads it)."""
    out = []
    for item in filter(None, text.split(",")):
        gemm, _, plan = item.partition(":")
        if gemm not in ("up", "down"):
            raise SystemExit(f"moe_gluon_mx: bad plan {item!r} (up|down:plan)")
        try:
            out.append((gemm, mx.parse_plan(plan)))
        except ValueError as e:
            raise SystemExit(f"moe_gluon_mx: {e}") from None
    return out


def prep_act(act: torch.Tensor, pl: dict[str, Any], E: int, k: int, BM: int, ab: int,
             order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The up GEMM's output rows as the down GEMM's e4m3 codes / scales (MMA order ``order``)."""
    rows, inter = act.shape
    aq = torch.zeros(rows, inter, dtype=torch.float8_e4m3fn, device=act.device)
    as_ = torch.zeros(rows, inter // ab, dtype=torch.float32, device=act.device)
    f8._fp8_prep_kernel[(pl["nb"], inter // ab)](
        act, pl["pairs"], pl["block_expert"], aq, as_, pl["P"], E, k, act.stride(0),
        aq.stride(0), as_.stride(0), GATHER=False, BM=BM, AB=ab, ORDER=order, num_warps=4)
    return aq, as_


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not mx.HAVE_GLUON:
        raise SystemExit("moe_gluon_mx: this triton has no Gluon")
    shape, device, tokens, gen, ex = bench_setup(args, "moe_gluon_mx", "8192,32768", "",
                                                 args.experts)
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    codes = f8.encode_fp8_codes(ex)
    if codes is None:
        raise SystemExit("moe_gluon_mx: the random stacks do not take the FP8-MMA path")
    ab = 128
    cfg = f8.PLAN_PREDECODED
    w1, s1, _ = _weight_args(ex, "w1")
    w3, s3, _ = _weight_args(ex, "w3")
    w2, s2, _ = _weight_args(ex, "w2")
    plans = parse_plans(args.plans)
    rows_out: list[dict[str, Any]] = []
    print(f"{E} experts, D {D}, I {inter}, top-{k}; Triton plan {cfg}")
    print("| tokens | GEMM | kernel | µs | TFLOP/s | output |")
    print("|---|---|---|---|---|---|")
    for T in tokens:
        x = torch.randn(T, D, generator=gen, device=device).to(torch.bfloat16)
        ids, w = routing(T, E, k, gen, device)
        wts = w.reshape(-1).float().contiguous()
        flops_up = 2 * 2 * T * k * D * inter
        flops_down = 2 * T * k * D * inter

        def row(gemm: str, kernel: str, us: float, flops: int, out: str) -> None:
            rows_out.append({"tokens": T, "gemm": gemm, "kernel": kernel, "us": us,
                             "tflops": flops / us / 1e6, "output": out})
            print(f"| {T} | {gemm} | {kernel} | {us:.1f} | {flops / us / 1e6:.0f} | {out} |",
                  flush=True)

        # References per row-block size: Triton on kept codes (64-row blocks; the 128-row
        # plans are checked against the Triton kernels on their own plan).
        refs: dict[int, dict[str, Any]] = {}

        def reference(BM: int) -> dict[str, Any]:
            if BM not in refs:
                # (256-row blocks: 2 stages, so the Triton kernels' tiles fit)
                c = replace(cfg, BM=BM, stages=2 if BM > 128 else cfg.stages)
                pl = prepped(x, ids, E, BM, ab)
                nrows = pl["nb"] * BM
                act_t = torch.zeros(nrows, inter, dtype=torch.bfloat16, device=device)
                triton_up(pl, codes, wts, act_t, c, ab)
                aq, as_ = prep_act(act_t, pl, E, k, BM, ab, 0)
                y_t = torch.zeros(pl["P"], D, dtype=torch.bfloat16, device=device)
                triton_down(pl, codes, aq, as_, y_t, c, ab)
                if BM == cfg.BM:
                    row("up", "triton, kept codes",
                        time_us(lambda: triton_up(pl, codes, wts, act_t, c, ab), device),
                        flops_up, "reference")
                    row("down", "triton, kept codes",
                        time_us(lambda: triton_down(pl, codes, aq, as_, y_t, c, ab), device),
                        flops_down, "reference")
                pl1 = prepped(x, ids, E, BM, ab, order=1)
                aq1, as1 = prep_act(act_t, pl1, E, k, BM, ab, 1)
                refs[BM] = {"pl": pl1, "act": act_t, "y": y_t, "aq": aq1, "as": as1,
                            "rows": (pl1["pairs"] < pl1["P"]).nonzero().squeeze(1),
                            "pairs": pl1["pairs"][pl1["pairs"] < pl1["P"]].long()}
            return refs[BM]

        reference(cfg.BM)
        for gemm, plan in plans:
            name = (f"mx BM{plan.BM} w{plan.warps} mt{plan.mt} s{plan.stages}"
                    f"{' pdec' if plan.persist else ' dec' if plan.dec else ''}"
                    f"{f' chain {plan.chain}' if plan.chain else ''}")
            try:
                r = reference(plan.BM)
                pl = r["pl"]
                if gemm == "up":
                    act_g = torch.full_like(r["act"], float("nan"))
                    fn = lambda: mx.gemm_up(pl["xq"], pl["xs"], w1, s1, w3, s3, pl["pairs"],
                                            pl["block_expert"], wts, act_g, pl["P"], LIMIT, ab,
                                            plan)
                    fn()
                    torch.cuda.synchronize()
                    row("up", name, time_us(fn, device), flops_up,
                        compare(act_g, r["act"], r["rows"]))
                else:
                    y_g = torch.full_like(r["y"], float("nan"))
                    fn = lambda: mx.gemm_down(r["aq"], r["as"], w2, s2, pl["pairs"],
                                              pl["block_expert"], y_g, pl["P"], ab, plan)
                    fn()
                    torch.cuda.synchronize()
                    row("down", name, time_us(fn, device), flops_down,
                        compare(y_g, r["y"], r["pairs"]))
            except Exception as e:  # one failing plan must not hide the others' numbers
                msg = str(e).splitlines()[0][:120] if str(e) else ""
                print(f"| {T} | {gemm} | {name} | failed: {type(e).__name__}: {msg} | | |",
                      flush=True)
        # The whole call: kept codes, per-call re-encoding, MXFP4 GEMMs (default plans).
        outs = {}
        for mode, exm, on in (("kept codes", replace(ex, fp8_codes=codes), False),
                              ("re-encoded", ex, False), ("mxfp4 (DSV4_FP8MMA_MX)", ex, True)):
            saved, mx.MX_PREFILL = mx.MX_PREFILL, on
            try:
                outs[mode] = f8.moe_experts_fp8mma(x, ids, w, exm, LIMIT, predecode=True)
                us = time_us(lambda: f8.moe_experts_fp8mma(x, ids, w, exm, LIMIT,
                                                           predecode=True), device)
            finally:
                mx.MX_PREFILL = saved
            out = (compare(outs[mode], outs["re-encoded"], torch.arange(T, device=device))
                   if on else "reference")
            row("call", mode, us, flops_up + flops_down, out)
        # The bf16-MMA kernels: what calls below fp8mma_applies' threshold run.
        from dsv4.ops import triton_moe
        y16 = triton_moe.moe_experts_with_config(x, ids, w, ex, LIMIT, None)
        us = time_us(lambda: triton_moe.moe_experts_with_config(x, ids, w, ex, LIMIT, None),
                     device)
        row("call", "bf16-MMA kernels", us, flops_up + flops_down,
            compare(y16, outs["re-encoded"], torch.arange(T, device=device)))
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
                    help="MXFP4 plans, comma-separated "
                         "gemm:BM:warps:mt:stages[:dec|:pdec[N]]")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
