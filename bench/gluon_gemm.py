"""The prefill experts' FP8 GEMMs on predecoded weights: Triton's (one wgmma waited at a time)
against the Gluon kernels of ``dsv4.ops.gluon_moe_fp8`` (each step's wgmma overlapping the
previous step's rescale), dsv4 issue #5.

One V4-Flash layer's routed experts at a prefill's routing (random top-6 of 256,
``triton_moe.moe_plan``; prepped e4m3 activations with power-of-two scales, predecoded codes
and factors of all 256 experts in one chunk): µs per call (``triton.testing.do_bench``),
TFLOP/s of the real pairs, and the bits against the Triton kernels at their default plan.
Each row runs in a child process with a time limit, so a kernel that hangs costs one row.
Gluon has no interpreter: this needs an sm_90 GPU.

    PYTHONPATH=. python bench/gluon_gemm.py [--tokens 8192] [--timeout 60]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import gluon_moe_fp8 as glm  # noqa: E402
from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402
from dsv4.ops.triton_moe import moe_plan  # noqa: E402

KS = AB = 128
E, D, INTER, TOPK = 256, 4096, 2048, 6
# (form, label, plan): the Triton default first (its BM, BN, warps, stages), then Gluon plans
# (BM, BN_up, BN_down, warps_up, warps_down, stages, unroll_up, unroll_down; only the form's
# own fields matter in its row) that compile without spills.
TRITON = f8.PLAN_PREDECODED
PLANS = [
    ("up", "triton", TRITON),
    ("up", "triton", f8.MoeFp8Config(BM=64, BN_up=128, BN_down=128, warps_up=8, warps_down=8,
                                     stages=5)),
    ("up", "gluon", glm.GluonPlan(64, 128, 128, 8, 8, 4, 1, 1)),      # no overlap: a control
    ("up", "gluon", glm.GluonPlan(64, 128, 128, 8, 8, 4, 2, 2)),
    ("up", "gluon", glm.GluonPlan(64, 128, 128, 8, 8, 5, 2, 2)),
    ("up", "gluon", glm.GluonPlan(64, 128, 128, 8, 8, 5, 1, 1)),
    ("down", "triton", TRITON),
    ("down", "triton", f8.MoeFp8Config(BM=64, BN_up=128, BN_down=128, warps_up=8, warps_down=8,
                                       stages=6)),
    ("down", "gluon", glm.GluonPlan(64, 64, 128, 4, 8, 4, 1, 1)),    # no overlap: a control
    ("down", "gluon", glm.GluonPlan(64, 64, 128, 4, 8, 6, 1, 1)),
    ("down", "gluon", glm.GluonPlan(64, 64, 128, 4, 8, 8, 1, 1)),
    ("down", "gluon", glm.GluonPlan(64, 64, 128, 4, 8, 8, 2, 2)),
    ("down", "gluon", glm.GluonPlan(64, 64, 128, 4, 8, 8, 4, 4)),
]


def problem(tokens: int, bm: int, form: str, seed: int = 0) -> dict:
    """Prepped activations (e4m3 codes, power-of-two scales) in the plan's rows, predecoded
    codes and factors of all E experts, the plan of a random routing.  The values drawn do
    not depend on ``bm`` (a pair's row is placed by the plan), so plans can be compared."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k = (INTER, D) if form == "up" else (D, INTER)
    P = tokens * TOPK
    ids = torch.rand(tokens, E, device="cuda", generator=g).argsort(dim=1)[:, :TOPK]

    def codes(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)

    def pow2(*shape):
        return torch.exp2(torch.randint(-4, 4, shape, device="cuda", generator=g).float())

    x_pairs, xs_pairs = codes(P, k), pow2(P, k // AB)
    p = {"n": n, "k": k, "P": P, "q1": codes(E, n, k), "f1": pow2(E, k // KS, n),
         "wts": torch.rand(P, device="cuda", generator=g)}
    if form == "up":
        p["q3"], p["f3"] = codes(E, n, k), pow2(E, k // KS, n)
    pairs, bexp = moe_plan(ids, E, bm)
    rows = bexp.numel() * bm
    real = pairs < P
    x = torch.zeros(rows, k, dtype=torch.uint8, device="cuda")
    x[real] = x_pairs.view(torch.uint8)[pairs[real].long()]
    xs = torch.ones(rows, k // AB, device="cuda")
    xs[real] = xs_pairs[pairs[real].long()]
    p.update(pairs=pairs, bexp=bexp, x=x.view(torch.float8_e4m3fn), xs=xs)
    p["out"] = torch.empty(rows if form == "up" else P, n, dtype=torch.bfloat16, device="cuda")
    return p


def launcher(p: dict, form: str, label: str, plan):
    """One GEMM over all experts (one chunk) as a closure."""
    n, k, P, nb = p["n"], p["k"], p["P"], p["bexp"].numel()
    x, xs, q1, f1, out = p["x"], p["xs"], p["q1"], p["f1"], p["out"]
    if label == "gluon":
        if form == "up":
            return lambda: glm.gluon_up(x, xs, q1, p["q3"], f1, p["f3"], p["pairs"], p["bexp"],
                                        p["wts"], out, P, 0, E, AB, KS, 10.0, plan)
        return lambda: glm.gluon_down(x, xs, q1, f1, p["pairs"], p["bexp"], out, P, 0, E, AB,
                                      KS, plan)
    bm, bn = plan.BM, plan.BN_up if form == "up" else plan.BN_down
    warps = plan.warps_up if form == "up" else plan.warps_down
    grid = (nb, triton.cdiv(n, bn))
    if form == "up":
        q3, f3 = p["q3"], p["f3"]
        return lambda: f8._fp8mma_up_kernel[grid](
            x, xs, q1, q3, f1, f3, p["pairs"], p["bexp"], p["wts"], out, P, n, k, 0, E,
            x.stride(0), xs.stride(0), out.stride(0), q1.stride(0), q1.stride(1),
            f1.stride(0), f1.stride(1), 10.0, HAS_LIMIT=True, ASM_DECODE=True, AB=AB,
            KS=KS, BM=bm, BN=bn, PREDECODED=True, num_warps=warps, num_stages=plan.stages)
    return lambda: f8._fp8mma_down_kernel[grid](
        x, xs, q1, f1, p["pairs"], p["bexp"], out, P, n, k, 0, E, x.stride(0),
        xs.stride(0), out.stride(0), q1.stride(0), q1.stride(1), f1.stride(0),
        f1.stride(1), ASM_DECODE=True, AB=AB, KS=KS, BM=bm, BN=bn, PREDECODED=True,
        num_warps=warps, num_stages=plan.stages)


def useful(out: torch.Tensor, p: dict, form: str) -> torch.Tensor:
    """The output rows of real pairs, in pair order (the up form's rows follow the plan)."""
    if form == "down":
        return out
    real = p["pairs"] < p["P"]
    return out[real][torch.argsort(p["pairs"][real])]


def run_one(tokens: int, index: int) -> str:
    """One table row: time, TFLOP/s of the real pairs, bits against the Triton kernel."""
    from triton.testing import do_bench
    form, label, plan = PLANS[index]
    p = problem(tokens, plan.BM, form)
    run = launcher(p, form, label, plan)
    run()
    torch.cuda.synchronize()
    got = useful(p["out"], p, form).clone()
    p0 = problem(tokens, TRITON.BM, form)       # same seed: the same routing, codes and scales
    launcher(p0, form, "triton", TRITON)()
    want = useful(p0["out"], p0, form)
    same = torch.equal(got, want)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    del p0, want
    us = do_bench(run, warmup=5, rep=60) * 1e3
    flops = 2 * p["P"] * p["n"] * p["k"] * (2 if form == "up" else 1)
    bits = "same" if same else f"rel {rel:.1e}"
    nan = " NaN" if torch.isnan(got).any() else ""
    desc = (f"{plan.BM}×{plan.BN_up if form == 'up' else plan.BN_down}, "
            f"{plan.warps_up if form == 'up' else plan.warps_down} warps, {plan.stages} stages"
            + (f", unroll {plan.unroll_up if form == 'up' else plan.unroll_down}"
               if label == "gluon" else ""))
    return (f"| {form} | {label} {desc} | {us:.1f} | {flops / us / 1e6:.0f} | {bits}{nan} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds per row (each row runs in a child: a hung kernel costs one)")
    ap.add_argument("--one", type=int, default=None, help="row INDEX of PLANS, in this process")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gluon_gemm: needs an sm_90 GPU (Gluon has no interpreter)")
    if args.one is not None:
        print(run_one(args.tokens, args.one), flush=True)
        return
    print(f"{args.tokens} tokens, top-{TOPK} of {E} experts, D {D}, I {INTER}; µs per call "
          "(triton.testing.do_bench), TFLOP/s of the real pairs")
    print("| form | kernel, plan | µs | TFLOP/s | bits vs Triton |")
    print("|---|---|---|---|---|", flush=True)
    for i, (form, label, plan) in enumerate(PLANS):
        cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--one", str(i)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("|")]
            err = (res.stderr.strip().splitlines() or ["?"])[-1][:200]
            print(line[-1] if line else f"| {form} | {label} {plan} | failed: {err} | | |",
                  flush=True)
        except subprocess.TimeoutExpired:
            print(f"| {form} | {label} {plan} | no result in {args.timeout:.0f} s (hung?) | | |",
                  flush=True)


if __name__ == "__main__":
    main()
