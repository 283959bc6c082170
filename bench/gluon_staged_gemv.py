"""Prototype: the one-token expert GEMM of ``dsv4.ops.gluon_moe_decode`` with its weights staged
through shared memory by ``cp.async`` (16 bytes a lane, ST chunks in flight without holding
registers), against the module's kernel, which loads each lane's A-fragment bytes straight
into registers (4 bytes a load, two chunks in flight).  Written without a GPU (twenty-ninth
session) for the question ``bench/gemv_load_probe.py`` asks: is the ~2.1 TB/s of the module's
GEMM bound by its load requests?  If the staged kernel streams faster, the module takes it.

    PYTHONPATH=. python bench/gluon_staged_gemv.py [--tokens 1] [--stages 2,3,4,6]  # GPU
    PYTHONPATH=. python bench/gluon_staged_gemv.py --sass                           # CPU

The staged kernel reads the activation as codes (``gm.x_codes``) and stores per-split fp32
partials (summed on the host for the check; the module's kernel sums them itself, so its
times include that).  The same math per chunk (``gm._chunk_sum``): the fragments are loaded
from shared memory in the module's byte layout, so the products are the module's bits.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import gluon_moe_decode as gm  # noqa: E402

E, D, INTER, TOPK = 256, 4096, 2048, 6


@gluon.jit
def _issue(w_s, s_s, w_ptr, s_ptr, src, ssrc, c, stage, N: gl.constexpr):
    """cp.async of chunk c's [BN, 64] code bytes and [BN] scale words into ``stage``."""
    async_copy.async_copy_global_to_shared(w_s.index(stage), w_ptr + src + c * (N * 64))
    async_copy.async_copy_global_to_shared(s_s.index(stage), s_ptr + ssrc + c * N)


@gluon.jit
def _fragments(w_s, s_s, stage, BYTE_L: gl.constexpr, row_l: gl.constexpr):
    """Chunk ``stage``'s four byte tiles in the A-fragment layout and its scale words: the
    tuple ``gm._chunk_sum`` takes."""
    w = w_s.index(stage)
    return (w.slice(0, 16, dim=1).load(BYTE_L), w.slice(16, 16, dim=1).load(BYTE_L),
            w.slice(32, 16, dim=1).load(BYTE_L), w.slice(48, 16, dim=1).load(BYTE_L),
            s_s.index(stage).load(row_l))


@gluon.jit
def _staged_kernel(w1_ptr, s1_ptr, w3_ptr, s3_ptr, xq_ptr, xs_ptr, pair_ptr, bexp_ptr, part_ptr,
                   P, E, N: gl.constexpr, K: gl.constexpr, TOPK: gl.constexpr,
                   TWO: gl.constexpr, TOKEN_ROWS: gl.constexpr, BM: gl.constexpr,
                   NT: gl.constexpr, WARPS: gl.constexpr, CPS: gl.constexpr, ST: gl.constexpr):
    """The module's ``_wgmma_gemv_kernel`` (ACT_CODES, one row tile a warp) with cp.async
    weight stages; fp32 partials part[split, blk, st, n, col]."""
    BN: gl.constexpr = 16 * WARPS
    BYTE_L: gl.constexpr = gm._byte_layout(WARPS, 1)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, NT, 32])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                              rank=2)
    xl_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
    # 16-byte granules, rows two by two in four phases: the fragments' 4-byte reads of 8 rows
    # × 4 lanes hit 32 banks.
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(16, 2, 4, order=[1, 0])
    s_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    cp_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    cs_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    NS: gl.constexpr = 2 if TWO else 1
    KR: gl.constexpr = CPS * 128
    pid_n = gl.program_id(0)
    blk = gl.program_id(1)
    split = gl.program_id(2)
    nblk = gl.num_programs(1)
    e = gl.load(bexp_ptr + blk)
    if (e >= 0) & (e < E):
        e64 = e.to(gl.int64)
        c0 = split * CPS
        # Weight stages: the first ST - 1 chunks requested before anything else.
        w1_s = gl.allocate_shared_memory(gl.uint8, [ST, BN, 64], w_sl)
        s1_s = gl.allocate_shared_memory(gl.int32, [ST, BN], s_sl)
        w3_s = gl.allocate_shared_memory(gl.uint8, [ST, BN, 64], w_sl)
        s3_s = gl.allocate_shared_memory(gl.int32, [ST, BN], s_sl)
        rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l))
        src = e64 * (N * (K // 2)) + rows[:, None] * 64 + gl.arange(
            0, 64, layout=gl.SliceLayout(0, cp_l))[None, :]
        ssrc = e64 * (N * (K // 128)) + pid_n * BN + gl.arange(0, BN, layout=cs_l)
        s1w = s1_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        s3w = s3_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        for s in gl.static_range(ST - 1):
            if s < CPS:
                _issue(w1_s, s1_s, w1_ptr, s1w, src, ssrc, c0 + s, s, N)
                if TWO:
                    _issue(w3_s, s3_s, w3_ptr, s3w, src, ssrc, c0 + s, s, N)
            async_copy.commit_group()
        # The activation codes (the module's ACT_CODES fill).
        px = gl.load(pair_ptr + blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(1, xl_l)))
        rx = blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(1, xl_l))
        if TOKEN_ROWS:
            rx = px // TOPK
        kx = gl.arange(0, KR, layout=gl.SliceLayout(0, xl_l))
        xv = gl.load(xq_ptr + rx.to(gl.int64)[:, None] * K + c0 * 128 + kx[None, :],
                     mask=(px < P)[:, None] & (kx >= 0)[None, :], other=0)
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [NT, KR], x_sl)
        x_s.store(xv.to(gl.float8e4nv, bitcast=True))
        fence_async_shared()
        pc = gl.load(pair_ptr + blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(0, acc_l)))
        valid = pc < P
        rc = blk * BM + gl.arange(0, NT, layout=gl.SliceLayout(0, acc_l))
        if TOKEN_ROWS:
            rc = pc // TOPK
        xs_base = xs_ptr + rc.to(gl.int64) * (K // 128)
        zero = gl.zeros([BN, NT], gl.float32, acc_l)
        acc1 = gl.zeros([BN, NT], gl.float32, acc_l)
        acc3 = gl.zeros([BN, NT], gl.float32, acc_l)
        for ci in gl.static_range(CPS):
            # Stage (ci - 1) % ST was read in the previous iteration: everyone is past it.
            gl.thread_barrier()
            if ci + ST - 1 < CPS:
                _issue(w1_s, s1_s, w1_ptr, s1w, src, ssrc, c0 + ci + ST - 1, (ci + ST - 1) % ST,
                       N)
                if TWO:
                    _issue(w3_s, s3_s, w3_ptr, s3w, src, ssrc, c0 + ci + ST - 1,
                           (ci + ST - 1) % ST, N)
            async_copy.commit_group()
            async_copy.wait_group(ST - 1)       # this thread's copies of chunk ci landed
            gl.thread_barrier()                 # and everyone's
            xs = gl.load(xs_base + c0 + ci, mask=valid, other=0.0)[None, :]
            xc = x_s.slice(ci * 128, 128, dim=1)
            acc1 = gl.fma(gm._chunk_sum(_fragments(w1_s, s1_s, ci % ST, BYTE_L, row_l), xc,
                                        zero, BN, a_l), xs, acc1)
            if TWO:
                acc3 = gl.fma(gm._chunk_sum(_fragments(w3_s, s3_s, ci % ST, BYTE_L, row_l),
                                            xc, zero, BN, a_l), xs, acc3)
        rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
        cols = gl.arange(0, NT, layout=gl.SliceLayout(0, acc_l))
        tile = (blk * NS * N + rn.to(gl.int64))[:, None] * NT + cols[None, :]
        gl.store(part_ptr + (split * nblk) * (NS * N * NT) + tile, acc1)
        if TWO:
            gl.store(part_ptr + (split * nblk) * (NS * N * NT) + N * NT + tile, acc3)


def staged(w1, s1, w3, s3, codes, scales, pairs, bexp, P, N, K, two, stages, cps=8,
           warps=4) -> torch.Tensor:
    """fp32 partials [splits, blocks, 1 or 2, N, 8] of one staged launch."""
    nb = bexp.numel()
    splits = K // (cps * 128)
    part = torch.zeros(splits, nb, 2 if two else 1, N, 8, device=codes.device)
    _staged_kernel[(N // (16 * warps), nb, splits)](
        w1, s1, w3 if two else w1, s3 if two else s1, codes, scales, pairs, bexp, part, P, E,
        N=N, K=K, TOPK=TOPK, TWO=two, TOKEN_ROWS=two, BM=gm.PLAN_BM, NT=8, WARPS=warps,
        CPS=cps, ST=stages, num_warps=warps)
    return part


def sass(stages: list[int]) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.gluon_fp4_gemv import _cuobjdump
    fn = _staged_kernel
    for two in (True, False):
        n, k = (INTER, D) if two else (D, INTER)
        for st in stages:
            consts = dict(N=n, K=k, TOPK=TOPK, TWO=two, TOKEN_ROWS=two, BM=gm.PLAN_BM, NT=8,
                          WARPS=4, CPS=8, ST=st)
            types = {"xs_ptr": "*fp32", "part_ptr": "*fp32", "pair_ptr": "*i32",
                     "bexp_ptr": "*i32"}
            sig, attrs = {}, {}
            for i, name in enumerate(fn.arg_names):
                if name in consts:
                    sig[name] = "constexpr"
                elif name.endswith("_ptr"):
                    sig[name] = types.get(name, "*u8")
                    attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    sig[name] = "i32"
            src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                                 constexprs={(fn.arg_names.index(c),): v
                                             for c, v in consts.items()})
            kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=4))
            asm = _cuobjdump(kern, "--dump-sass")
            regs = re.search(r"REG:(\d+)", _cuobjdump(kern, "--dump-resource-usage"))
            kinds = sorted(set(re.findall(r"LDGSTS(?:\.\w+)*", asm)))
            print(f"{'up' if two else 'down'} ST={st}: LDGSTS {asm.count('LDGSTS')} {kinds}, "
                  f"LDS {asm.count('LDS')}, regs {regs.group(1) if regs else '?'}, "
                  f"shared {kern.metadata.shared} B")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--stages", default="2,3,4,6")
    ap.add_argument("--rotate", type=int, default=4)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    if args.sass:
        sass(stages)
        return
    from bench.flash_bench import graph_time
    from bench.gluon_fp4_gemv import _dequant_codes, dequant_kchunk
    from bench.moe_decode import mxfp4_stacks, routing
    from dsv4.ops import triton_moe as tm

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ex = mxfp4_stacks(E, D, INTER, gen, dev, kchunk=True)
    u8 = torch.uint8
    w1, s1, w3, s3, w2, s2 = (t.view(u8) for t in (ex.w1, ex.s1, ex.w3, ex.s3, ex.w2, ex.s2))
    print(f"# {torch.cuda.get_device_name()}: one-token expert GEMMs, µs per call "
          f"({args.rotate} routings rotated)")
    print("| tokens | GEMM | kernel | µs | GB/s | rel err vs float64 |")
    print("|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        P = T * TOPK
        calls = []
        for _ in range(args.rotate):
            ids, _ = routing(T, E, TOPK, gen, dev)
            pairs, bexp = tm.moe_plan(ids, E, gm.PLAN_BM)
            x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
            act = torch.randn(pairs.numel(), INTER, generator=gen, device=dev)
            calls.append((ids, pairs, bexp, gm.x_codes(x), gm.x_codes(act.bfloat16())))
        distinct = sum(int(torch.unique(c[0]).numel()) for c in calls) / len(calls)
        for name, n, k, two in (("up", INTER, D, True), ("down", D, INTER, False)):
            wa, sa, wb, sb = (w1, s1, w3, s3) if two else (w2, s2, None, None)
            nbytes = distinct * n * k * (0.5 + 1 / 32) * (2 if two else 1)
            ids, pairs, bexp, xc, ac = calls[0]
            codes = xc if two else ac
            rows_ok = pairs < P
            ref = {}
            for b in range(3):
                e = int(bexp[b])
                rows = torch.arange(b * gm.PLAN_BM, b * gm.PLAN_BM + 8, device=dev)
                rows = rows[rows_ok[rows]]
                if e < E and rows.numel():
                    xin = _dequant_codes(*codes)[(pairs[rows].long() // TOPK) if two
                                                 else rows.long()]
                    ref[b] = (rows - b * gm.PLAN_BM, xin @ dequant_kchunk(wa, sa, e, n, k).T)
            for st in [0] + stages:
                if st == 0:       # the module's kernel, its split-K sum included
                    plan = gm.pick_plan(n, k, two)

                    def run(c, two=two, n=n, k=k, plan=plan):
                        ids, pairs, bexp, xc, ac = c
                        out = torch.empty((2, pairs.numel(), n) if two else (P, n),
                                          dtype=torch.float32 if two else torch.bfloat16,
                                          device=dev)
                        gm._gemv(wa, sa, wb, sb, (xc if two else ac)[0], gm.ACT_CODES, pairs,
                                 bexp, out, P, E, n, k, TOPK, 8, plan,
                                 act_scale=(xc if two else ac)[1], token_rows=two)
                        return out
                else:
                    def run(c, two=two, n=n, k=k, st=st):
                        ids, pairs, bexp, xc, ac = c
                        codes = xc if two else ac
                        return staged(wa, sa, wb, sb, codes[0], codes[1], pairs, bexp, P, n, k,
                                      two, st)
                out = run(calls[0])
                errs = []
                for b, (cols, want) in ref.items():
                    if st == 0:
                        got = (out[0, b * gm.PLAN_BM + cols].double() if two
                               else out[pairs[b * gm.PLAN_BM + cols].long()].double())
                    else:
                        got = out[:, b, 0, :, :].sum(0).T[cols].double()
                    errs.append(((got - want).norm() / want.norm()).item())
                us = graph_time(lambda: [run(c) for c in calls], args.replays) / len(calls) * 1e6
                what = "module (registers, split-K summed)" if st == 0 else f"staged, {st} stages"
                print(f"| {T} | {name} | {what} | {us:.1f} | {nbytes / us / 1e3:.0f} | "
                      f"{max(errs):.1e} |", flush=True)


if __name__ == "__main__":
    main()
