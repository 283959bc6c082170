"""Does Hopper warp specialization speed up the block-scaled FP8 expert GEMMs?  (dsv4 issue #5)

The prefill experts' FP8 GEMMs (``triton_moe_fp8``, predecoded weights) rescale every 128-wide
K step's dot in fp32 (``acc = dot · sa[row] · sw[col] + acc``), so each warp waits on its dot
before the next one: ~440 TFLOP/s on the H200.  Triton 3.6's Hopper automatic warp
specialization (``tl.range(..., warp_specialize=True)`` with ``num_warps=4`` and TMA tensor
descriptors; with 8 warps or pointer loads no partition is made, ``bench/ws_probe.py``) splits
the loop into a TMA producer and two consumer warpgroups that wait on their dots independently,
so one's rescale overlaps the other's MMA.

This script times the same grouped GEMM (row blocks of one expert each, the predecoded layout:
codes [E, N, K] e4m3, factors [E, K / 128, N] fp32; activations e4m3 [rows, K] with fp32
scales [rows, K / 128]) with and without the flag, the up form (w1 and w3, two accumulators)
and the down form (one), and checks each against torch (relative error).

    PYTHONPATH=. python bench/ws_gemm.py [--rows-per-expert 192] [--experts 256]
    PYTHONPATH=. python bench/ws_gemm.py --compile-only   # offline sm_90: partitions, shared
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

KS = 128


@triton.jit
def _grouped_fp8_gemm(x_desc, xs_ptr, w1_desc, w3_desc, f1_ptr, f3_ptr, bexp_ptr, out_ptr, N, K,
                      stride_xs, stride_fe, stride_out, BM: tl.constexpr, BN: tl.constexpr,
                      KS: tl.constexpr, TWO: tl.constexpr, WS: tl.constexpr,
                      STAGES: tl.constexpr):
    """out[rows of block, N tile] = Σ_k dot(x8, w8ᵀ) · xs[row, k] · f[e, k, n] (and the w3 GEMM:
    out = acc1 · acc3 when TWO, a stand-in for the SwiGLU epilogue that reads both)."""
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + blk)
    rm = blk * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    wrow = e * N + pid_n * BN
    f1 = f1_ptr + e.to(tl.int64) * stride_fe + rn
    f3 = f3_ptr + e.to(tl.int64) * stride_fe + rn
    acc1 = tl.zeros((BM, BN), tl.float32)
    acc3 = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, K, KS, num_stages=STAGES, warp_specialize=WS):
        step = k0 // KS
        a = x_desc.load([blk * BM, k0])
        sa = tl.load(xs_ptr + rm * stride_xs + step)
        g = w1_desc.load([wrow, k0])
        sg = tl.load(f1 + step * N)
        acc1 = tl.fma(tl.dot(a, g.T) * sa[:, None], sg[None, :], acc1)
        if TWO:
            u = w3_desc.load([wrow, k0])
            su = tl.load(f3 + step * N)
            acc3 = tl.fma(tl.dot(a, u.T) * sa[:, None], su[None, :], acc3)
    if TWO:
        acc1 = acc1 * acc3
    tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc1.to(tl.bfloat16))


def make_problem(experts: int, rows_per_expert: int, n: int, k: int, bm: int, device: str):
    """Random codes and power-of-two scales; rows padded to BM per expert (as the plan's)."""
    blocks_per_expert = triton.cdiv(rows_per_expert, bm)
    rows = experts * blocks_per_expert * bm
    g = torch.Generator(device=device).manual_seed(0)

    def codes(*shape):
        v = torch.randn(*shape, device=device, generator=g) * 2
        return v.clamp(-448, 448).to(torch.float8_e4m3fn)

    def pow2(*shape):
        return torch.exp2(torch.randint(-4, 4, shape, device=device, generator=g).float())

    x = codes(rows, k)
    xs = pow2(rows, k // KS)
    w1, w3 = codes(experts, n, k), codes(experts, n, k)
    f1, f3 = pow2(experts, k // KS, n), pow2(experts, k // KS, n)
    bexp = torch.arange(experts, device=device, dtype=torch.int32).repeat_interleave(
        blocks_per_expert)
    return x, xs, w1, w3, f1, f3, bexp


def reference(x, xs, w, f, bexp, bm: int) -> torch.Tensor:
    """fp32 torch of the same sums (dequantized operands), all rows."""
    rows, k = x.shape
    xd = x.float() * xs.repeat_interleave(KS, dim=1)
    e_of_row = bexp.repeat_interleave(bm).long()
    out = torch.empty(rows, w.shape[1], device=x.device)
    for e in range(w.shape[0]):
        sel = e_of_row == e
        wd = w[e].float() * f[e].repeat_interleave(KS, dim=0).T
        out[sel] = xd[sel] @ wd.T
    return out


def launch(problem, two: bool, bm: int, bn: int, warps: int, stages: int, ws: bool):
    x, xs, w1, w3, f1, f3, bexp = problem
    E, N, K = w1.shape
    out = torch.empty(x.shape[0], N, device=x.device, dtype=torch.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x, [bm, KS])
    w1_desc = TensorDescriptor.from_tensor(w1.view(E * N, K), [bn, KS])
    w3_desc = TensorDescriptor.from_tensor(w3.view(E * N, K), [bn, KS])

    def run():
        _grouped_fp8_gemm[(bexp.numel(), triton.cdiv(N, bn))](
            x_desc, xs, w1_desc, w3_desc, f1, f3, bexp, out, N, K, xs.stride(0),
            f1.stride(0), out.stride(0), BM=bm, BN=bn, KS=KS, TWO=two, WS=ws, STAGES=stages,
            num_warps=warps)
    return run, out


PLANS = [  # (BM, BN, warps, stages, ws); the first is the current predecoded plan's tile
    (64, 128, 8, 4, False),
    (128, 128, 8, 3, False),
    (128, 128, 4, 3, True),
    (128, 128, 4, 4, True),
    (128, 64, 4, 4, True),
    (64, 128, 4, 4, True),
    (128, 256, 4, 3, True),
]


def compile_only() -> None:
    """Offline sm_90 compile of each plan: partitions made, shared memory, registers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"x_desc": "tensordesc<fp8e4nv[128, 128]>", "xs_ptr": "*fp32",
           "w1_desc": "tensordesc<fp8e4nv[128, 128]>", "w3_desc": "tensordesc<fp8e4nv[128, 128]>",
           "f1_ptr": "*fp32", "f3_ptr": "*fp32", "bexp_ptr": "*i32", "out_ptr": "*bf16",
           "N": "i32", "K": "i32", "stride_xs": "i32", "stride_fe": "i32", "stride_out": "i32"}
    for two in (True, False):
        for bm, bn, warps, stages, ws in PLANS:
            s = dict(sig)
            s["x_desc"] = f"tensordesc<fp8e4nv[{bm}, {KS}]>"
            s["w1_desc"] = s["w3_desc"] = f"tensordesc<fp8e4nv[{bn}, {KS}]>"
            const = {"BM": bm, "BN": bn, "KS": KS, "TWO": two, "WS": ws, "STAGES": stages}
            for c in const:
                s[c] = "constexpr"
            try:
                kern = triton.compile(ASTSource(fn=_grouped_fp8_gemm, signature=s,
                                                constexprs=const),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps})
                g = kern.asm["ttgir"]
                print(f"two={two} {bm}x{bn} w{warps} s{stages} ws={ws}: partitions "
                      f"{g.count('ttg.warp_specialize(')}, shared {kern.metadata.shared}, "
                      f"regs {kern.n_regs if hasattr(kern, 'n_regs') else '-'} "
                      f"spills {getattr(kern, 'n_spills', '-')}")
            except Exception as exc:  # report and go on: a plan that does not compile
                print(f"two={two} {bm}x{bn} w{warps} s{stages} ws={ws}: "
                      f"{type(exc).__name__}: {str(exc)[:300]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--rows-per-expert", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available():
        sys.exit("ws_gemm: needs a GPU (or --compile-only)")
    from triton.testing import do_bench
    rpe = args.rows_per_expert
    forms = [("up", True, args.inter, args.hidden), ("down", False, args.hidden, args.inter)]
    print(f"| form | plan (BM, BN, warps, stages, ws) | µs | TFLOP/s (useful rows) | "
          f"rel. error |")
    print("|---|---|---|---|---|")
    for name, two, n, k in forms:
        for bm, bn, warps, stages, ws in PLANS:
            problem = make_problem(args.experts, rpe, n, k, bm, "cuda")
            try:
                run, out = launch(problem, two, bm, bn, warps, stages, ws)
                run()
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"| {name} | {bm}, {bn}, {warps}, {stages}, {ws} | {type(exc).__name__}: "
                      f"{str(exc)[:120]} | | |")
                continue
            x, xs, w1, w3, f1, f3, bexp = problem
            ref = reference(x, xs, w1, f1, bexp, bm)
            if two:
                ref = ref * reference(x, xs, w3, f3, bexp, bm)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            nan = bool(torch.isnan(out).any())
            us = do_bench(run, warmup=10, rep=100) * 1e3
            flops = 2 * args.experts * rpe * n * k * (2 if two else 1)
            print(f"| {name} | {bm}, {bn}, {warps}, {stages}, {ws} | {us:.1f} | "
                  f"{flops / us / 1e6:.0f} | {err:.1e}{' NaN' if nan else ''} |")
            del problem, out, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
