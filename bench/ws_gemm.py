"""TMA tiles and Hopper warp specialization for the prefill experts' FP8 GEMMs (dsv4 issue #5).

The GEMMs on predecoded weights (``dsv4.ops.triton_moe_fp8``) rescale every 128-wide K step's
dot in fp32 (``acc = dot · sa[row] · f[col] + acc``), so each warp waits on its dot before the
next one (~440 TFLOP/s in the 8K prefill).  Triton 3.6 partitions such a loop on sm_90 when it
reads TMA descriptors, runs 4 warps and asks for it (``tl.range(..., warp_specialize=True)``:
a TMA producer and two consumer warpgroups that wait on their own dots, so one's rescale
overlaps the other's MMA); with pointer loads or 8 warps it does not (``bench/ws_probe.py``).

This times the model's kernels on one V4-Flash layer's routed experts at an 8K prefill's
routing (random top-6 of 256, ``triton_moe.moe_plan``): the pointer-load kernels
(``_fp8mma_up_kernel`` / ``_fp8mma_down_kernel`` PREDECODED, the default plan) against
``_fp8mma_up_tma_kernel`` / ``_fp8mma_down_tma_kernel`` over a few plans with and without the
partition, and checks that every plan gives the pointer kernels' bits.  Each row runs in a
child process with a time limit, so a kernel that hangs costs one row.

    PYTHONPATH=. python bench/ws_gemm.py [--tokens 8192] [--timeout 60]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402
from dsv4.ops.triton_moe import moe_plan  # noqa: E402

KS = AB = 128
E, D, INTER, TOPK = 256, 4096, 2048, 6
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (label, BM, BN, warps, stages, loads): the first is the default plan (pointer loads).
PLANS = [
    ("default", 64, 128, 8, 4, "ptr"),
    ("tma", 64, 128, 8, 4, "tma"),
    ("tma", 128, 128, 8, 3, "tma"),
    ("ws", 128, 128, 4, 3, "ws"),
    ("ws", 128, 128, 4, 4, "ws"),
    ("ws", 128, 64, 4, 4, "ws"),
    ("ws", 64, 128, 4, 4, "ws"),
]


def problem(tokens: int, bm: int, form: str, seed: int = 0) -> dict:
    """Prepped activations (e4m3 codes, power-of-two scales) in the plan's rows, predecoded
    codes and factors of all E experts, the plan of a random routing.  The values drawn do
    not depend on ``bm`` (a pair's row is placed by the plan), so plans can be compared."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    n, k = (INTER, D) if form == "up" else (D, INTER)
    P = tokens * TOPK
    ids = torch.rand(tokens, E, device=DEV, generator=g).argsort(dim=1)[:, :TOPK]

    def codes(*shape):
        return (torch.randn(*shape, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)

    def pow2(*shape):
        return torch.exp2(torch.randint(-4, 4, shape, device=DEV, generator=g).float())

    x_pairs, xs_pairs = codes(P, k), pow2(P, k // AB)
    p = {"n": n, "k": k, "P": P, "q1": codes(E, n, k), "f1": pow2(E, k // KS, n),
         "wts": torch.rand(P, device=DEV, generator=g)}
    if form == "up":
        p["q3"], p["f3"] = codes(E, n, k), pow2(E, k // KS, n)
    pairs, bexp = moe_plan(ids, E, bm)
    rows = bexp.numel() * bm
    real = pairs < P
    x = torch.zeros(rows, k, dtype=torch.uint8, device=DEV)
    x[real] = x_pairs.view(torch.uint8)[pairs[real].long()]
    xs = torch.ones(rows, k // AB, device=DEV)
    xs[real] = xs_pairs[pairs[real].long()]
    p.update(pairs=pairs, bexp=bexp, x=x.view(torch.float8_e4m3fn), xs=xs)
    p["out"] = torch.empty(rows if form == "up" else P, n, dtype=torch.bfloat16, device=DEV)
    return p


def launcher(p: dict, form: str, bm: int, bn: int, warps: int, stages: int, loads: str):
    """The model's launch of one GEMM (all experts in one chunk) as a closure."""
    n, k, P, nb = p["n"], p["k"], p["P"], p["bexp"].numel()
    grid = (nb, triton.cdiv(n, bn))
    x, xs, q1, f1, out = p["x"], p["xs"], p["q1"], p["f1"], p["out"]
    if form == "up":
        q3, f3 = p["q3"], p["f3"]
        if loads == "ptr":
            return lambda: f8._fp8mma_up_kernel[grid](
                x, xs, q1, q3, f1, f3, p["pairs"], p["bexp"], p["wts"], out, P, n, k, 0, E,
                x.stride(0), xs.stride(0), out.stride(0), q1.stride(0), q1.stride(1),
                f1.stride(0), f1.stride(1), 10.0, HAS_LIMIT=True, ASM_DECODE=True, AB=AB,
                KS=KS, BM=bm, BN=bn, PREDECODED=True, num_warps=warps, num_stages=stages)
        descs = (f8._tile_desc(x, bm, KS), f8._tile_desc(q1, bn, KS), f8._tile_desc(q3, bn, KS))
        return lambda: f8._fp8mma_up_tma_kernel[grid](
            descs[0], xs, descs[1], descs[2], f1, f3, p["pairs"], p["bexp"], p["wts"], out, P,
            n, k, 0, E, xs.stride(0), out.stride(0), f1.stride(0), 10.0, HAS_LIMIT=True,
            AB=AB, KS=KS, BM=bm, BN=bn, STAGES=stages, WS=loads == "ws", num_warps=warps)
    if loads == "ptr":
        return lambda: f8._fp8mma_down_kernel[grid](
            x, xs, q1, f1, p["pairs"], p["bexp"], out, P, n, k, 0, E, x.stride(0),
            xs.stride(0), out.stride(0), q1.stride(0), q1.stride(1), f1.stride(0),
            f1.stride(1), ASM_DECODE=True, AB=AB, KS=KS, BM=bm, BN=bn, PREDECODED=True,
            num_warps=warps, num_stages=stages)
    descs = (f8._tile_desc(x, bm, KS), f8._tile_desc(q1, bn, KS))
    return lambda: f8._fp8mma_down_tma_kernel[grid](
        descs[0], xs, descs[1], f1, p["pairs"], p["bexp"], out, P, n, k, 0, E, xs.stride(0),
        out.stride(0), f1.stride(0), AB=AB, KS=KS, BM=bm, BN=bn, STAGES=stages,
        WS=loads == "ws", num_warps=warps)


def useful(out: torch.Tensor, p: dict, form: str, bm: int) -> torch.Tensor:
    """The output rows of real pairs, in pair order (the up form's rows follow the plan)."""
    if form == "down":
        return out
    real = p["pairs"] < p["P"]
    return out[real][torch.argsort(p["pairs"][real])]


def run_one(tokens: int, form: str, index: int) -> str:
    """One table row: time, TFLOP/s of the real pairs, bits against the default plan."""
    from triton.testing import do_bench
    label, bm, bn, warps, stages, loads = PLANS[index]
    p = problem(tokens, bm, form)
    run = launcher(p, form, bm, bn, warps, stages, loads)
    run()
    if DEV == "cuda":
        torch.cuda.synchronize()
    got = useful(p["out"], p, form, bm).clone()
    _, bm0, bn0, w0, s0, l0 = PLANS[0]
    p0 = problem(tokens, bm0, form)       # same seed: the same routing, codes and scales
    launcher(p0, form, bm0, bn0, w0, s0, l0)()
    want = useful(p0["out"], p0, form, bm0)
    same = torch.equal(got, want)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    del p0, want
    us = do_bench(run, warmup=5, rep=60) * 1e3 if DEV == "cuda" else float("nan")
    flops = 2 * p["P"] * p["n"] * p["k"] * (2 if form == "up" else 1)
    bits = "same" if same else f"rel {rel:.1e}"
    nan = " NaN" if torch.isnan(got).any() else ""
    return (f"| {form} | {label} {bm}×{bn}, {warps} warps, {stages} stages | {us:.1f} | "
            f"{flops / us / 1e6:.0f} | {bits}{nan} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds per row (each row runs in a child: a hung kernel costs one)")
    ap.add_argument("--one", default=None, help="FORM:INDEX — one row, in this process")
    ap.add_argument("--tiny", action="store_true",
                    help="toy widths, one row per form, no timing (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.tiny:
        global E, D, INTER
        E, D, INTER = 8, 256, 256
        for form in ("up", "down"):
            for i in (1, 3):
                print(run_one(args.tokens, form, i), flush=True)
        return
    if not torch.cuda.is_available():
        sys.exit("ws_gemm: needs a GPU (or --tiny under TRITON_INTERPRET=1)")
    if args.one:
        form, index = args.one.split(":")
        print(run_one(args.tokens, form, int(index)), flush=True)
        return
    print(f"{args.tokens} tokens, top-{TOPK} of {E} experts, D {D}, I {INTER}; µs per call "
          "(triton.testing.do_bench), TFLOP/s of the real pairs")
    print("| form | plan | µs | TFLOP/s | bits vs default |")
    print("|---|---|---|---|---|", flush=True)
    for form in ("up", "down"):
        for i, plan in enumerate(PLANS):
            cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--one", f"{form}:{i}"]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                line = [ln for ln in res.stdout.splitlines() if ln.startswith("|")]
                err = (res.stderr.strip().splitlines() or ["?"])[-1][:160]
                print(line[-1] if line else f"| {form} | {plan} | failed: {err} | | |",
                      flush=True)
            except subprocess.TimeoutExpired:
                print(f"| {form} | {plan} | no result in {args.timeout:.0f} s (hung?) | | |",
                      flush=True)


if __name__ == "__main__":
    main()
