"""A decode-sized MXFP4 expert GEMM on FP8 tensor cores with explicit register layouts (Gluon),
measured against the Triton expert kernels (dsv4 issue #5: the routed experts at one token take
~2.6x their bytes, bound by ~4 SASS instructions per weight; docs/PERFORMANCE.md).

The experiment: weights on the MMA's M side (16 rows a tile), tokens on its N side (8 columns),
one ``mma.sync m16n8k32`` e4m3 product per 32-wide MXFP4 scale group.  Each lane loads exactly
the bytes its A fragment needs (4 packed bytes of a row's group = 8 codes), turns them into two
registers of e4m3 bytes with a few integer operations (e2m1 · 2^-6 is an e4m3 code with the
e2m1 bits moved: sign to bit 7, magnitude to bits 2-4, exact), and the layouts are chosen so that
no register moves between the load, the decode and the MMA (``convert_layout(...,
assert_trivial=True)`` checks it at compile time).  The group's e8m0 scale then multiplies the
fp32 product per row (exact, a power of two), the activation's per-128 scale per token.

The K order inside a group is permuted (a dot does not depend on it): MMA column 16h + 4q + i
of group g is natural column 32g + 8q + 2i + h, so the activation codes are stored per group as
[16 even columns | 16 odd columns] (:func:`activation_codes`).  Weights: the model's K-chunk-major
MXFP4 stacks (chunks of 128 columns, ``ExpertWeights.kchunk``), read in place.

    PYTHONPATH=. python bench/gluon_fp4_gemv.py --sass        # CPU: sm_90 SASS per weight
    PYTHONPATH=. python bench/gluon_fp4_gemv.py               # GPU: check + time vs Triton

Gluon has no interpreter (triton 3.6): this runs on an sm_90 GPU or compiles offline only.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNK = gl.constexpr(128)   # K columns per chunk of the K-chunk-major stacks (64 bytes a row)
GROUP = gl.constexpr(32)    # MXFP4 scale group = one m16n8k32 MMA
NTOK = gl.constexpr(8)      # token columns of one MMA

# Four packed bytes (8 e2m1 codes: lo nibble = even column) -> the e4m3 bytes of e2m1 · 2^-6
# of the even codes ($0) and of the odd codes ($1): sign to bit 7, magnitude (3 bits) to 2-4.
_E2M1X8_TO_E4M3 = """{
.reg .b32 a, b;
shl.b32 a, $2, 4;
shl.b32 b, $2, 2;
and.b32 a, a, 0x80808080;
and.b32 b, b, 0x1C1C1C1C;
or.b32 $0, a, b;
shr.b32 b, $2, 2;
and.b32 a, $2, 0x80808080;
and.b32 b, b, 0x1C1C1C1C;
or.b32 $1, a, b;
}"""


def _log2(n: int) -> int:
    assert n > 0 and n & (n - 1) == 0, n
    return n.bit_length() - 1


def byte_layout(warps: int, mtiles: int) -> gl.DistributedLinearLayout:
    """[16·warps·mtiles, 16] packed bytes of one scale group, each lane holding what its A
    fragment wants: lane (r, q) the 4 bytes 4q..4q+3 of rows r and r + 8 of each 16-row tile."""
    rows = 16 * warps * mtiles
    regs = [[0, 1], [0, 2], [8, 0]] + [[16 * warps << j, 0] for j in range(_log2(mtiles))]
    lanes = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    wbases = [[16 << j, 0] for j in range(_log2(warps))]
    return gl.DistributedLinearLayout(regs, lanes, wbases, [], [rows, 16])


@gluon.jit
def _fp4_gemv_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, blk_e_ptr, blk_t_ptr, out_ptr,
                     N, K, chunks_per_split,
                     WARPS: gl.constexpr, MT: gl.constexpr, BYTE_L: gl.constexpr):
    """out[split, block, n, j] = Σ_k W[e_block, n, k] · x[tok_block_j, k] over the split's K
    chunks (fp32; j < 8 token columns, tok -1 = none).  Grid (row tiles, blocks, splits)."""
    BN: gl.constexpr = 16 * WARPS * MT
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    pid_n = gl.program_id(0)
    blk = gl.program_id(1)
    split = gl.program_id(2)
    e = gl.load(blk_e_ptr + blk).to(gl.int64)

    # Weight bytes of group g of chunk c: w + e·(N·K/2) + c·(N·64) + row·64 + 16g + col.
    rb = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, BYTE_L))
    cb = gl.arange(0, 16, layout=gl.SliceLayout(0, BYTE_L))
    w_base = w_ptr + e * N * (K // 2) + rb[:, None] * 64 + cb[None, :]
    # Scales of the rows (the accumulator's row layout): s + e·(N·K/32) + c·(N·4) + row·4 + g.
    rs = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    s_base = s_ptr + e * N * (K // 32) + rs * 4
    # Activation codes [32, 8] of group g in the B operand's layout, and the token columns.
    kb = gl.arange(0, GROUP, layout=gl.SliceLayout(1, b_l))
    tb = gl.load(blk_t_ptr + blk * NTOK + gl.arange(0, NTOK, layout=gl.SliceLayout(0, b_l)))
    x_base = xq_ptr + tb.to(gl.int64)[None, :] * K + kb[:, None]
    x_mask = (tb >= 0)[None, :] & (kb >= 0)[:, None]
    ta = gl.load(blk_t_ptr + blk * NTOK + gl.arange(0, NTOK, layout=gl.SliceLayout(0, mma)))
    xs_base = xs_ptr + ta.to(gl.int64) * (K // CHUNK)
    t_mask = ta >= 0

    acc = gl.zeros([BN, NTOK], gl.float32, mma)
    zero = gl.zeros([BN, NTOK], gl.float32, mma)
    c0 = split * chunks_per_split
    for c in range(c0, c0 + chunks_per_split):
        acc_c = gl.zeros([BN, NTOK], gl.float32, mma)
        for g in gl.static_range(CHUNK // GROUP):
            byte = gl.load(w_base + c * (N * 64) + g * 16)
            lo, hi = gl.inline_asm_elementwise(_E2M1X8_TO_E4M3_C, "=r,=r,r", [byte],
                                               dtype=(gl.uint8, gl.uint8), is_pure=True,
                                               pack=4)
            # [rows, 16 bytes, (even, odd)] -> [rows, (h, q, i)]: MMA column 16h + 4q + i.
            codes = gl.join(lo, hi)
            codes = gl.reshape(codes, [BN, 4, 4, 2])
            codes = gl.permute(codes, [0, 3, 1, 2])
            codes = gl.reshape(codes, [BN, GROUP])
            a = gl.convert_layout(codes.to(gl.float8e4nv, bitcast=True), a_l,
                                  assert_trivial=True)
            xb = gl.load(x_base + c * CHUNK + g * GROUP, mask=x_mask, other=0)
            b = xb.to(gl.float8e4nv, bitcast=True)
            prod = gl.nvidia.ampere.mma_v2(a, b, zero)
            sb = gl.load(s_base + c * (N * 4) + g).to(gl.int32)
            # 2^(s - 127) · 2^6 (the codes are e2m1 · 2^-6); e8m0 bytes 1..248 here.
            ws = ((sb + 6) << 23).to(gl.float32, bitcast=True)
            acc_c = acc_c + prod * ws[:, None]
        xs = gl.load(xs_base + c, mask=t_mask, other=0.0)
        acc = acc + acc_c * xs[None, :]
    ro = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    co = gl.arange(0, NTOK, layout=gl.SliceLayout(0, mma))
    nblk = gl.num_programs(1)
    gl.store(out_ptr + ((split * nblk + blk) * N + ro.to(gl.int64))[:, None] * NTOK + co[None, :],
             acc)



@gluon.jit
def _fp4_wgmma_kernel(w_ptr, s_ptr, xq_ptr, xs_ptr, blk_e_ptr, blk_t_ptr, out_ptr,
                      N: gl.constexpr, K: gl.constexpr, WARPS: gl.constexpr,
                      MT: gl.constexpr, CPS: gl.constexpr, PF: gl.constexpr,
                      BYTE_L: gl.constexpr):
    """The contract of :func:`_fp4_gemv_kernel` (CPS chunks a split) on Hopper's native FP8
    wgmma: the decoded weight codes are its register A operand (64 rows a warpgroup), the
    split's activation codes [8 tokens, CPS·128] sit in shared memory (K-major B); the four
    groups of a chunk are four asynchronous products, each scaled into the chunk's sum."""
    BN: gl.constexpr = 16 * WARPS * MT
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, 8, 32])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
    x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                              rank=2)
    xl_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
    pid_n = gl.program_id(0)
    blk = gl.program_id(1)
    split = gl.program_id(2)
    e = gl.load(blk_e_ptr + blk).to(gl.int64)
    c0 = split * CPS

    # The split's activation codes into shared memory, once.
    KR: gl.constexpr = CPS * CHUNK
    tx = gl.load(blk_t_ptr + blk * NTOK + gl.arange(0, NTOK, layout=gl.SliceLayout(1, xl_l)))
    kx = gl.arange(0, KR, layout=gl.SliceLayout(0, xl_l))
    xv = gl.load(xq_ptr + tx.to(gl.int64)[:, None] * K + c0 * CHUNK + kx[None, :],
                 mask=(tx >= 0)[:, None] & (kx >= 0)[None, :], other=0)
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [NTOK, KR], x_sl)
    x_s.store(xv.to(gl.float8e4nv, bitcast=True))
    fence_async_shared()
    gl.thread_barrier()

    rb = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, BYTE_L))
    cb = gl.arange(0, 16, layout=gl.SliceLayout(0, BYTE_L))
    w_base = w_ptr + e * N * (K // 2) + rb[:, None] * 64 + cb[None, :]
    rs = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    s_base = s_ptr + e * N * (K // 32) + rs * 4
    ta = gl.load(blk_t_ptr + blk * NTOK + gl.arange(0, NTOK, layout=gl.SliceLayout(0, acc_l)))
    xs_base = xs_ptr + ta.to(gl.int64) * (K // CHUNK)
    t_mask = ta >= 0

    acc = gl.zeros([BN, NTOK], gl.float32, acc_l)
    zero = gl.zeros([BN, NTOK], gl.float32, acc_l)
    # Chunk c + PF's bytes and scales are loaded before chunk c's products are issued (PF
    # chunks in flight a thread: the loads' latency is what bounds a one-token call).
    b0, b1, b2, b3, sw = _load_chunk(w_base, s_base, c0, N)
    if PF >= 2:
        if CPS > 1:
            n0, n1, n2, n3, nsw = _load_chunk(w_base, s_base, c0 + 1, N)
    if PF >= 3:
        if CPS > 2:
            m0, m1, m2, m3, msw = _load_chunk(w_base, s_base, c0 + 2, N)
    for ci in gl.static_range(CPS):
        c = c0 + ci
        if ci + PF < CPS:
            f0, f1, f2, f3, fsw = _load_chunk(w_base, s_base, c + PF, N)
        xs = gl.load(xs_base + c, mask=t_mask, other=0.0)
        xc = x_s.slice(ci * CHUNK, CHUNK, dim=1)
        p0 = warpgroup_mma(_decode(b0, BN, a_l), xc.slice(0, GROUP, dim=1).permute((1, 0)),
                           zero, use_acc=False, is_async=True)
        p1 = warpgroup_mma(_decode(b1, BN, a_l), xc.slice(GROUP, GROUP, dim=1).permute((1, 0)),
                           zero, use_acc=False, is_async=True)
        p2 = warpgroup_mma(_decode(b2, BN, a_l),
                           xc.slice(2 * GROUP, GROUP, dim=1).permute((1, 0)),
                           zero, use_acc=False, is_async=True)
        p3 = warpgroup_mma(_decode(b3, BN, a_l),
                           xc.slice(3 * GROUP, GROUP, dim=1).permute((1, 0)),
                           zero, use_acc=False, is_async=True)
        d0, d1, d2, d3 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1, p2, p3))
        # 2^(s - 127) · 2^6 per group (the codes are e2m1 · 2^-6); e8m0 bytes 1..248 here.
        acc_c = d0 * (((sw & 255) + 6) << 23).to(gl.float32, bitcast=True)[:, None]
        acc_c = gl.fma(d1, ((((sw >> 8) & 255) + 6) << 23).to(gl.float32, bitcast=True)[:, None],
                       acc_c)
        acc_c = gl.fma(d2, ((((sw >> 16) & 255) + 6) << 23).to(gl.float32,
                                                                bitcast=True)[:, None], acc_c)
        acc_c = gl.fma(d3, ((((sw >> 24) & 255) + 6) << 23).to(gl.float32,
                                                                bitcast=True)[:, None], acc_c)
        acc = gl.fma(acc_c, xs[None, :], acc)
        # Rotate the slots: current <- next <- next but one <- the chunk just loaded.
        if PF == 1:
            if ci + 1 < CPS:
                b0, b1, b2, b3, sw = f0, f1, f2, f3, fsw
        if PF == 2:
            if ci + 1 < CPS:
                b0, b1, b2, b3, sw = n0, n1, n2, n3, nsw
            if ci + 2 < CPS:
                n0, n1, n2, n3, nsw = f0, f1, f2, f3, fsw
        if PF == 3:
            if ci + 1 < CPS:
                b0, b1, b2, b3, sw = n0, n1, n2, n3, nsw
            if ci + 2 < CPS:
                n0, n1, n2, n3, nsw = m0, m1, m2, m3, msw
            if ci + 3 < CPS:
                m0, m1, m2, m3, msw = f0, f1, f2, f3, fsw
    ro = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    co = gl.arange(0, NTOK, layout=gl.SliceLayout(0, acc_l))
    nblk = gl.num_programs(1)
    gl.store(out_ptr + ((split * nblk + blk) * N + ro.to(gl.int64))[:, None] * NTOK + co[None, :],
             acc)


@gluon.jit
def _load_chunk(w_base, s_base, c, N):
    """Chunk c's packed bytes, group by group ([BN, 16] each, the byte layout), and its four
    scale bytes a row as one int32 ([BN], the accumulator's row layout)."""
    w = w_base + c * (N * 64)
    return (gl.load(w), gl.load(w + 16), gl.load(w + 32), gl.load(w + 48),
            gl.load((s_base + c * (N * 4)).to(gl.pointer_type(gl.int32), bitcast=True)))


@gluon.jit
def _decode(byte, BN: gl.constexpr, a_l: gl.constexpr):
    """Packed bytes [BN, 16] of one group -> e4m3 codes [BN, 32] in the A operand layout
    (MMA column 16h + 4q + i: lane (r, q) holds its bytes' even codes, then the odd ones)."""
    lo, hi = gl.inline_asm_elementwise(_E2M1X8_TO_E4M3_C, "=r,=r,r", [byte],
                                       dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    codes = gl.reshape(gl.permute(gl.reshape(gl.join(lo, hi), [BN, 4, 4, 2]), [0, 3, 1, 2]),
                       [BN, GROUP])
    return gl.convert_layout(codes.to(gl.float8e4nv, bitcast=True), a_l, assert_trivial=True)

_E2M1X8_TO_E4M3_C = gl.constexpr(_E2M1X8_TO_E4M3)


# ------------------------------------------------------------------------------ offline SASS
def compile_sm90(warps: int, mtiles: int, kind: str = "mma", cps: int = 8, pf: int = 1):
    """The kernel compiled for sm_90 without a GPU (pointers and sizes divisible by 16)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _fp4_gemv_kernel if kind == "mma" else _fp4_wgmma_kernel
    types = {"w_ptr": "*u8", "s_ptr": "*u8", "xq_ptr": "*u8", "xs_ptr": "*fp32",
             "blk_e_ptr": "*i32", "blk_t_ptr": "*i32", "out_ptr": "*fp32",
             "N": "i32", "K": "i32", "chunks_per_split": "i32"}
    consts = {"WARPS": warps, "MT": mtiles, "BYTE_L": byte_layout(warps, mtiles)}
    if kind != "mma":
        consts.update(CPS=cps, PF=pf, N=4096, K=4096)
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        sig[n] = "constexpr" if n in consts else types[n]
        if n in ("w_ptr", "s_ptr", "xq_ptr", "xs_ptr", "out_ptr", "N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))


def _regs(k) -> str:
    """Registers a thread (from the SASS header; '?' if not found)."""
    from bench.moe_sass_count import loop_counts  # noqa: F401 (same tool location)

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    m = re.search(r"REG:(\d+)", res)
    s = re.search(r"STACK:(\d+)", res)
    return f"regs {m.group(1) if m else '?'}, stack {s.group(1) if s else '?'}"


def sass_report(warps: int, mtiles: int, kind: str = "mma", cps: int = 8, pf: int = 1) -> str:
    """Instructions of the K loop per weight (per thread), by opcode."""
    from bench.moe_sass_count import loop_counts

    k = compile_sm90(warps, mtiles, kind, cps, pf)
    if kind == "mma":
        n, ops, sass = loop_counts(k.asm["cubin"])
    else:
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True,
                                  text=True, check=True).stdout
    weights = 16 * mtiles * CHUNK.value // 32     # per thread per chunk
    if kind != "mma":   # unrolled: the whole kernel, per chunk
        body = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
        ops = collections.Counter(
            re.sub(r"^@!?U?P\w+\s+", "", ln.split("*/", 1)[1].strip()).split()[0].split(".")[0]
            for ln in body)
        ops = collections.Counter({o: -(-c // cps) for o, c in ops.items()})
        n = sum(ops.values())
    top = ", ".join(f"{o} {c}" for o, c in ops.most_common(10))
    return (f"{kind} warps {warps} mtiles {mtiles} cps {cps} pf {pf}: {n} instr per chunk, "
            f"{weights} weights a thread: "
            f"{n / weights:.2f} per weight; {_regs(k)} | {top}")


# ------------------------------------------------------------------------------ GPU run
def e4m3_codes(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 fake quantization per ``block`` columns (amax floor 1e-4, power-of-two scale, e4m3
    round to nearest): (codes uint8 [T, K], scales fp32 [T, K / block])."""
    T, K = x.shape
    xb = x.float().view(T, K // block, block)
    amax = xb.abs().amax(-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    codes = (xb / scale[..., None]).to(torch.float8_e4m3fn).view(T, K)
    return codes.view(torch.uint8), scale


def activation_codes(codes: torch.Tensor) -> torch.Tensor:
    """Per 32-column group: its 16 even columns, then its 16 odd ones (the MMA column order)."""
    T, K = codes.shape
    g = codes.view(T, K // 32, 16, 2)
    return torch.cat([g[..., 0], g[..., 1]], dim=-1).reshape(T, K).contiguous()


def dequant_kchunk(w: torch.Tensor, s: torch.Tensor, e: int, N: int, K: int) -> torch.Tensor:
    """Expert e of a K-chunk-major MXFP4 stack as fp64 [N, K] (reference, spec e2m1 values)."""
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                       dtype=torch.float64, device=w.device)
    b = w[e].reshape(K // CHUNK.value, N, 64).to(torch.int32) & 255     # [C, N, 64]
    vals = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).reshape(K // CHUNK.value, N, 128)
    sc = s[e].reshape(K // CHUNK.value, N, 4).to(torch.float64)
    vals = vals * torch.exp2(sc - 127).repeat_interleave(32, dim=-1)
    return vals.permute(1, 0, 2).reshape(N, K)


def launch(kind: str, w, s, xq, xs, blk_e, blk_t, N: int, K: int, warps: int, mt: int,
           cps: int, pf: int = 1) -> torch.Tensor:
    """Partial sums [splits, blocks, N, 8] of one call."""
    bn = 16 * warps * mt
    splits = K // (cps * CHUNK.value)
    out = torch.empty(splits, blk_e.numel(), N, NTOK.value, device=w.device)
    grid = (N // bn, blk_e.numel(), splits)
    if kind == "mma":
        _fp4_gemv_kernel[grid](w, s, xq, xs, blk_e, blk_t, out, N, K, cps, WARPS=warps, MT=mt,
                               BYTE_L=byte_layout(warps, mt), num_warps=warps)
    else:
        _fp4_wgmma_kernel[grid](w, s, xq, xs, blk_e, blk_t, out, N, K, WARPS=warps, MT=mt,
                                CPS=cps, PF=pf, BYTE_L=byte_layout(warps, mt), num_warps=warps)
    return out


def gpu_main(args: argparse.Namespace) -> None:
    from bench.flash_bench import graph_time
    from bench.moe_decode import mxfp4_stacks, routing
    from dsv4.ops import triton_moe as tri

    dev = "cuda"
    print(f"# {torch.cuda.get_device_name()}; MXFP4 K-chunk-major stacks, 6 experts a call "
          f"(T tokens: top-6 each), rotated over {args.rotate} calls")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, D, inter = 256, 4096, 2048
    ex = mxfp4_stacks(E, D, inter, gen, dev, kchunk=True)
    # The up GEMM as one stack of N = 2·inter rows (w1 | w3 bytes; its K chunks interleave
    # differently from the model's two stacks, same bytes a call), the down GEMM as w2.
    shapes = {"up": (2 * inter, D), "down": (D, inter)}
    stacks = {"up": (torch.randint(-128, 128, (E, 2 * inter, D // 2), generator=gen,
                                   device=dev, dtype=torch.int8).view(torch.uint8),
                     torch.randint(118, 123, (E, 2 * inter, D // 32), generator=gen,
                                   device=dev).to(torch.uint8)),
              "down": (ex.w2.view(torch.uint8), ex.s2.view(torch.uint8))}
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        calls = [routing(T, E, 6, gen, dev) for _ in range(args.rotate)]
        xs_in = [torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
                 for _ in range(args.rotate)]
        # Triton's whole expert call (up + act prep + down + combine), the default plan.
        fns = [lambda x=x, c=c: tri.moe_experts(x, c[0], c[1], ex, 10.0)
               for x, c in zip(xs_in, calls)]
        [f() for f in fns]
        t_tri = graph_time(lambda: [f() for f in fns], args.replays) / len(fns) * 1e6
        rows.append((T, "triton moe_experts (up+down+combine)", t_tri, "", ""))
        print("| %d | %s | %.1f | %s | %s |" % rows[-1], flush=True)
        for name, (N, K) in shapes.items():
            w, s = stacks[name]
            ins = []
            for x, (ids, _) in zip(xs_in, calls):
                xk = x if K == D else torch.randn(T, K, generator=gen, device=dev)
                codes, scale = e4m3_codes(xk)
                pairs = [(int(e), t) for t in range(T) for e in ids[t].tolist()]
                experts = sorted({e for e, _ in pairs})
                toks = torch.full((len(experts), 8), -1, dtype=torch.int32)
                for bi, e in enumerate(experts):
                    ts = [t for ee, t in pairs if ee == e][:8]
                    toks[bi, :len(ts)] = torch.tensor(ts, dtype=torch.int32)
                ins.append((activation_codes(codes), scale.contiguous(),
                            torch.tensor(experts, dtype=torch.int32, device=dev),
                            toks.to(dev), codes, scale))
            nbytes = sum(len(i[2]) for i in ins) / len(ins) * N * K * (0.5 + 1 / 32)
            # Reference on the first call, a few experts.
            xq, xsc, be, bt, codes, scale = ins[0]
            xdq = (codes.view(torch.float8_e4m3fn).double().view(T, K // 128, 128)
                   * scale.double()[..., None]).view(T, K)
            for kind, warps, mt, cps, pf in PLANS:
                if K // (cps * CHUNK.value) < 1:
                    continue
                try:
                    out = launch(kind, w, s, xq, xsc, be, bt, N, K, warps, mt, cps, pf).sum(0)
                    errs = []
                    for bi in range(min(3, be.numel())):
                        wd = dequant_kchunk(w, s, int(be[bi]), N, K)
                        tk = bt[bi][bt[bi] >= 0].long()
                        ref = wd @ xdq[tk].T                          # [N, tokens]
                        got = out[bi][:, :tk.numel()].double()
                        errs.append(((got - ref).norm() / ref.norm()).item())
                    finite = bool(torch.isfinite(out).all())
                    fns = [lambda i=i: launch(kind, w, s, i[0], i[1], i[2], i[3], N, K, warps,
                                              mt, cps, pf) for i in ins]
                    us = graph_time(lambda: [f() for f in fns], args.replays) / len(fns) * 1e6
                    rows.append((T, f"{name} {kind} w{warps} mt{mt} cps{cps} pf{pf}", us,
                                 f"{nbytes / us / 1e3:.0f} GB/s", f"rel {max(errs):.1e} "
                                 f"finite {finite}"))
                except Exception as e:  # noqa: BLE001 - report and go on
                    rows.append((T, f"{name} {kind} w{warps} mt{mt} cps{cps} pf{pf}", float("nan"),
                                 "", f"{type(e).__name__}: {str(e)[:150]}"))
                print("| %d | %s | %.1f | %s | %s |" % rows[-1], flush=True)
        # The bytes alone: a copy of one call's up + down weights.
        src = torch.empty(int(6 * 3 * inter * D * (0.5 + 1 / 32)), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        t_copy = graph_time(lambda: dst.copy_(src), args.replays) * 1e6
        print(f"| {T} | copy of 6 experts' bytes (read + write: 2x) | {t_copy:.1f} | | |")


# (kind, warps, row tiles a warp, chunks a split, chunks prefetched)
PLANS = [("wgmma", 4, 1, 8, 1), ("wgmma", 4, 1, 8, 2), ("wgmma", 4, 1, 8, 3),
         ("wgmma", 4, 1, 4, 2), ("wgmma", 4, 1, 4, 3), ("wgmma", 4, 1, 16, 3),
         ("wgmma", 4, 2, 8, 2), ("wgmma", 4, 2, 4, 2), ("wgmma", 8, 1, 8, 2),
         ("wgmma", 8, 1, 4, 3), ("mma", 4, 1, 8, 1)]


def op_main(args: argparse.Namespace) -> None:
    """The whole decode expert call: Triton's grouped kernels against
    ``dsv4.ops.gluon_moe_decode.moe_experts_wgmma`` (V4-Flash, 256 K-chunk-major experts,
    official numerics), CUDA-graph replays of rotated routings, and their difference."""
    from bench.flash_bench import graph_time
    from bench.moe_decode import mxfp4_stacks, routing
    from dsv4.ops import gluon_moe_decode as gm
    from dsv4.ops import torch_dense as ref
    from dsv4.ops import triton_moe as tri

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    E, D, inter = 256, 4096, 2048
    ex = mxfp4_stacks(E, D, inter, gen, dev, kchunk=True)
    print(f"# {torch.cuda.get_device_name()}: routed experts, V4-Flash widths, µs per call")
    print("| tokens | Triton grouped | wgmma (Gluon) | ratio | rel diff | rel vs twin (Triton / "
          "wgmma) |")
    print("|---|---|---|---|---|---|")
    for T in [int(t) for t in args.tokens.split(",")]:
        calls = [(torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16),
                  *routing(T, E, 6, gen, dev)) for _ in range(args.rotate)]
        f_tri = [lambda c=c: tri.moe_experts_with_config(c[0], c[1], c[2], ex, 10.0)
                 for c in calls]
        f_wg = [lambda c=c: gm.moe_experts_wgmma(c[0], c[1], c[2], ex, 10.0) for c in calls]
        a, b = f_tri[0](), f_wg[0]()
        twin = ref.moe_experts(*calls[0], ex, 10.0)

        def rel(u: torch.Tensor, v: torch.Tensor) -> float:
            return ((u.double() - v.double()).norm() / v.double().norm()).item()
        t_tri = graph_time(lambda: [f() for f in f_tri], args.replays) / len(calls) * 1e6
        t_wg = graph_time(lambda: [f() for f in f_wg], args.replays) / len(calls) * 1e6
        print(f"| {T} | {t_tri:.1f} | {t_wg:.1f} | {t_tri / t_wg:.2f}x | {rel(b, a):.1e} | "
              f"{rel(a, twin):.1e} / {rel(b, twin):.1e} |", flush=True)


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
        for kind, warps, mt, cps, pf in PLANS:
            print(sass_report(warps, mt, kind, cps, pf))
        return
    op_main(args) if args.op else gpu_main(args)


if __name__ == "__main__":
    main()
