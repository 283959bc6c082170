"""The decode expert GEMMs on FP8 wgmma with the MXFP4 codes decoded in registers
(``dsv4.ops.gluon_moe_decode``, dsv4 issue #5): offline sm_90 SASS instructions per weight, and
on the GPU the GEMMs alone per tile plan (against a float64 reference) and the whole expert call
against Triton's grouped kernels.

    PYTHONPATH=. python bench/gluon_fp4_gemv.py --sass              # CPU: SASS per weight
    PYTHONPATH=. python bench/gluon_fp4_gemv.py [--tokens 1,2]      # GPU: the GEMMs per plan
    PYTHONPATH=. python bench/gluon_fp4_gemv.py --op [--tokens ..]  # GPU: the whole call

V4-Flash widths (D 4096, I 2048, 256 K-chunk-major experts, top-6), official numerics;
CUDA-graph replays of rotated routings.  The GEMM rows time ``_wgmma_gemv_kernel`` with its
split-K reduction, w1 + w3 ("up", fp32 out) and w2 ("down", bf16 out).  The twenty-eighth
session's prototype (its own kernels, and an ``mma.sync`` variant that sm_90 runs as f16 HMMAs
after F2FP conversions: exact to 3.5e-8 but slower) is at commit ``f535f33``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compress_sass import sass_opcodes  # noqa: E402
from dsv4.ops import gluon_moe_decode as gm  # noqa: E402

E, D, INTER, TOPK = 256, 4096, 2048, 6
# Tile plans timed (the default first): warps, row tiles a warp, chunks a split, in flight.
# (The cp.async-staged plans were removed with the option, thirty-first session.)
PLANS = [gm.pick_plan(INTER, D), gm.GemvPlan(4, 1, 8, 1), gm.GemvPlan(4, 1, 4, 2),
         gm.GemvPlan(4, 2, 8, 2), gm.GemvPlan(8, 1, 8, 2), gm.GemvPlan(4, 1, 16, 2)]


# ------------------------------------------------------------------------------ offline SASS
def compile_sm90(plan: gm.GemvPlan, two: bool = True, nt: int = 8, fused: bool = True):
    """``_wgmma_gemv_kernel`` compiled for sm_90 without a GPU (the up GEMM's widths with
    ``two``, else the down GEMM's; pointers divisible by 16); ``fused``: the activation
    quantized in the kernel's fill (the default path), else read as codes."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gm._wgmma_gemv_kernel
    n, k = (INTER, D) if two else (D, INTER)
    act = (gm.ACT_TOKENS if two else gm.ACT_SWIGLU) if fused else gm.ACT_CODES
    consts = dict(N=n, K=k, TOPK=TOPK, TWO=two, ACT=act, TOKEN_ROWS=two and not fused,
                  HAS_LIMIT=not two, BM=gm.PLAN_BM, NT=nt, WARPS=plan.warps, MT=plan.mt,
                  CPS=plan.cps, PF=plan.pf, S=k // (plan.cps * gm.CHUNK), PDL=True)
    a_type = ("*bf16" if two else "*fp32") if fused else "*u8"
    types = {"a_ptr": a_type, "as_ptr": "*fp32", "wt_ptr": "*fp32", "part_ptr": "*fp32",
             "pair_ptr": "*i32", "bexp_ptr": "*i32", "arrivals_ptr": "*i32",
             "out_ptr": "*fp32" if two else "*bf16", "limit": "fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = types.get(name, "*u8")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = types.get(name, "i32")
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                         constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=plan.warps))


def _cuobjdump(kernel, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_report(plan: gm.GemvPlan, two: bool = True, fused: bool = True) -> str:
    """SASS instructions per chunk and per weight a thread (the K loop is unrolled: the whole
    kernel over its chunks, prologue, activation fill and epilogue included), registers, top
    opcodes."""
    k = compile_sm90(plan, two, fused=fused)
    body, ops = sass_opcodes(_cuobjdump(k, "--dump-sass"))
    per_chunk = len(body) / plan.cps
    weights = (2 if two else 1) * 16 * plan.mt * gm.CHUNK // 32     # a thread, a chunk
    regs = re.search(r"REG:(\d+)", _cuobjdump(k, "--dump-resource-usage"))
    top = ", ".join(f"{o} {-(-c // plan.cps)}" for o, c in ops.most_common(8))
    what = ("tokens' fill" if two else "swiglu fill") if fused else "codes"
    return (f"{'up' if two else 'down'} ({what}) {plan}: {per_chunk:.0f} instr a chunk, "
            f"{weights} weights a thread: {per_chunk / weights:.2f} a weight; "
            f"regs {regs.group(1) if regs else '?'}, shared {k.metadata.shared} B | {top}")


# ------------------------------------------------------------------------------ GPU
def dequant_kchunk(w: torch.Tensor, s: torch.Tensor, e: int, N: int, K: int) -> torch.Tensor:
    """Expert e of a K-chunk-major MXFP4 stack as fp64 [N, K] (``formats.dequant_mxfp4`` of
    its row-major bytes)."""
    from dsv4.formats import dequant_mxfp4
    from dsv4.ops.torch_dense import kchunk_rows
    codes = kchunk_rows(w[e].reshape(N, K // 2), gm.CHUNK // 2).view(torch.int8)
    scales = kchunk_rows(s[e].reshape(N, K // 32), gm.CHUNK // 32)
    return dequant_mxfp4(codes, scales.view(torch.uint8), torch.float32).double()


def _dequant_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp64 values of MMA-ordered e4m3 codes [R, K] with their per-128 scales."""
    R, K = codes.shape
    perm = gm.mma_column(torch.arange(K, device=codes.device))
    v = codes[:, perm].view(torch.float8_e4m3fn).double().view(R, K // 128, 128)
    return (v * scale.double()[..., None]).view(R, K)


def gemm_main(args: argparse.Namespace) -> None:
    """The two GEMMs alone per plan: µs, GB/s of the distinct experts' bytes, error of the
    first call's first three blocks against float64.  "codes": the activation read as codes
    (x_codes / act_codes made them, untimed); "fill": quantized in the kernel (the default
    path, with ``pick_plan``'s plan)."""
    from bench.flash_bench import graph_time
    from bench.moe_decode import mxfp4_stacks, routing
    from dsv4.ops import triton_moe as tm

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ex = mxfp4_stacks(E, D, INTER, gen, dev, kchunk=True)
    u8 = torch.uint8
    w1, s1, w3, s3 = (t.view(u8) for t in (ex.w1, ex.s1, ex.w3, ex.s3))
    w2, s2 = ex.w2.view(u8), ex.s2.view(u8)
    print(f"# {torch.cuda.get_device_name()}: the GEMMs of gluon_moe_decode, µs per call "
          f"({args.rotate} routings rotated)")
    print("| tokens | GEMM | activation | plan | µs | GB/s | rel err vs float64 |")
    print("|---|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        P, nt = T * TOPK, gm.mma_columns(T)
        calls = []
        for _ in range(args.rotate):
            ids, w = routing(T, E, TOPK, gen, dev)
            pairs, bexp = tm.moe_plan(ids, E, gm.PLAN_BM)
            x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
            h = torch.randn(2, pairs.numel(), INTER, generator=gen, device=dev)
            wts = w.reshape(-1).float().contiguous()
            ac = gm.act_codes(h, pairs, bexp, wts, P, E, gm.PLAN_BM, 10.0)
            calls.append((ids, pairs, bexp, x, gm.x_codes(x), h, wts, ac))
        distinct = sum(int(torch.unique(c[0]).numel()) for c in calls) / len(calls)
        for name, n, k in (("up", INTER, D), ("down", D, INTER)):
            nbytes = distinct * n * k * (0.5 + 1 / 32) * (2 if name == "up" else 1)
            for plan, fill in ([(pl, False) for pl in PLANS]
                               + [(gm.pick_plan(n, k, name == "up"), True)]):
                if k % (plan.cps * gm.CHUNK) or n % plan.rows:
                    continue

                def run(c, plan=plan, name=name, n=n, k=k, fill=fill) -> torch.Tensor:
                    ids, pairs, bexp, x, xc, h, wts, ac = c
                    if name == "up":
                        out = torch.empty(2, pairs.numel(), n, device=dev)
                        if fill:
                            gm._gemv(w1, s1, w3, s3, x, gm.ACT_TOKENS, pairs, bexp, out, P, E,
                                     n, k, TOPK, nt, plan)
                        else:
                            gm._gemv(w1, s1, w3, s3, xc[0], gm.ACT_CODES, pairs, bexp, out, P,
                                     E, n, k, TOPK, nt, plan, act_scale=xc[1], token_rows=True)
                    else:
                        out = torch.empty(P, n, dtype=torch.bfloat16, device=dev)
                        if fill:
                            gm._gemv(w2, s2, None, None, h, gm.ACT_SWIGLU, pairs, bexp, out, P,
                                     E, n, k, TOPK, nt, plan, weights=wts, limit=10.0)
                        else:
                            gm._gemv(w2, s2, None, None, ac[0], gm.ACT_CODES, pairs, bexp, out,
                                     P, E, n, k, TOPK, nt, plan, act_scale=ac[1])
                    return out
                out = run(calls[0])
                ids, pairs, bexp, x, xc, h, wts, ac = calls[0]
                errs = []
                for b in range(3):
                    e = int(bexp[b])
                    rows = torch.arange(b * gm.PLAN_BM, (b + 1) * gm.PLAN_BM, device=dev)
                    rows = rows[pairs[rows] < P]
                    if e >= E or not rows.numel():
                        continue
                    if name == "up":
                        xin = _dequant_codes(*xc)[pairs[rows].long() // TOPK]
                        ref = xin @ dequant_kchunk(w1, s1, e, n, k).T
                        got = out[0, rows.long()].double()
                    else:
                        ref = _dequant_codes(*ac)[rows.long()] @ dequant_kchunk(w2, s2, e, n, k).T
                        got = out[pairs[rows].long()].double()
                    errs.append(((got - ref).norm() / ref.norm()).item())
                us = graph_time(lambda: [run(c) for c in calls], args.replays) / len(calls) * 1e6
                print(f"| {T} | {name} | {'fill' if fill else 'codes'} | {plan} | {us:.1f} | "
                      f"{nbytes / us / 1e3:.0f} | {max(errs):.1e} |", flush=True)


def op_main(args: argparse.Namespace) -> None:
    """The whole decode expert call: Triton's grouped kernels against
    ``dsv4.ops.gluon_moe_decode.moe_experts_wgmma`` (V4-Flash, 256 K-chunk-major experts,
    official numerics), CUDA-graph replays of rotated routings, and their difference."""
    from bench.flash_bench import graph_time
    from bench.moe_decode import mxfp4_stacks, routing
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    E, D, inter = 256, 4096, 2048
    ex = mxfp4_stacks(E, D, inter, gen, dev, kchunk=True)
    print(f"# {torch.cuda.get_device_name()}: routed experts, V4-Flash widths, µs per call")
    print("| tokens | Triton grouped | wgmma, 5 launches | wgmma (3) | ratio | rel diff | "
          "rel vs twin (Triton / wgmma) | 3 = 5 launches' bits |")
    print("|---|---|---|---|---|---|---|---|")
    fused = gm.FUSED_FILL
    for T in [int(t) for t in args.tokens.split(",")]:
        calls = [(torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16),
                  *routing(T, E, 6, gen, dev)) for _ in range(args.rotate)]
        cfg = tri.pick_moe_config(T * 6, E, D, inter, 128)   # the grouped kernels' own plan
        f_tri = [lambda c=c: tri.moe_experts_with_config(c[0], c[1], c[2], ex, 10.0, cfg)
                 for c in calls]
        f_wg = [lambda c=c: gm.moe_experts_wgmma(c[0], c[1], c[2], ex, 10.0) for c in calls]
        times = []
        outs = []
        for fill in (False, True):
            gm.FUSED_FILL = fill
            outs.append(f_wg[0]())
            times.append(graph_time(lambda: [f() for f in f_wg], args.replays) / len(calls) * 1e6)
        gm.FUSED_FILL = fused
        a, b = f_tri[0](), outs[1]
        twin = ref.moe_experts(*calls[0], ex, 10.0)

        def rel(u: torch.Tensor, v: torch.Tensor) -> float:
            return ((u.double() - v.double()).norm() / v.double().norm()).item()
        t_tri = graph_time(lambda: [f() for f in f_tri], args.replays) / len(calls) * 1e6
        print(f"| {T} | {t_tri:.1f} | {times[0]:.1f} | {times[1]:.1f} | {t_tri / times[1]:.2f}x"
              f" | {rel(b, a):.1e} | {rel(a, twin):.1e} / {rel(b, twin):.1e} | "
              f"{torch.equal(outs[0], outs[1])} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sass", action="store_true", help="offline sm_90 SASS counts (CPU)")
    ap.add_argument("--op", action="store_true",
                    help="the whole expert call: Triton against dsv4.ops.gluon_moe_decode")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--rotate", type=int, default=4)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    if args.sass:
        for plan in PLANS:
            print(sass_report(plan, fused=False))
        down = gm.pick_plan(D, INTER, two=False)
        print(sass_report(down, two=False, fused=False))
        print(sass_report(PLANS[0]))
        print(sass_report(down, two=False))
        return
    op_main(args) if args.op else gemm_main(args)


if __name__ == "__main__":
    main()
