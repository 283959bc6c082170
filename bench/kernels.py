"""Time the Triton kernels at V4-Flash shapes against the H200 roofline.

    PYTHONPATH=. python bench/kernels.py [--sweep] [--out results.json]

Per op and shape: the kernel's device time (CUDA-graph replay, inputs rotated over enough
copies to defeat the 60 MB L2), the eager time (``triton.testing.do_bench`` median: includes the
Python launch), a torch baseline (eager), the bytes and FLOPs it must move/do, the floor
``max(bytes / 4.29 TB/s, FLOPs / peak)`` (peak: 1459 TFLOP/s fp8, 792 bf16, per shared/GPU.md)
and time / floor.  ``--sweep`` also times tile-plan candidates and prints the best per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from typing import Callable

import torch
import triton

from dsv4 import formats
from dsv4.cache.formats import PackedRows, v4_kv_record
from dsv4.ops import torch_attn, torch_dense
from dsv4.ops import triton_attn as ta
from dsv4.ops import triton_dense as td
from dsv4.ops import triton_mhc

BW = 4.29e12
PEAK = {"fp8": 1459e12, "bf16": 792e12, "fp32": 792e12}
L2_BYTES = 60 << 20
DEV = "cuda"


def copies_for(nbytes: int) -> int:
    """How many input sets to rotate so one pass over them overflows L2 (capped)."""
    return max(1, min(16, -(-4 * L2_BYTES // max(1, nbytes))))


def time_graph(calls: list[Callable[[], object]], target_ms: float = 3.0) -> float:
    """Median device time (µs) of one call, from CUDA-graph replays cycling through ``calls``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls * 2:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    # Estimate one call to size the graph.
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for f in calls:
        f()
    t1.record()
    torch.cuda.synchronize()
    per = max(t0.elapsed_time(t1) / len(calls), 1e-3)
    n = max(len(calls), min(2000, int(target_ms / per)))
    n = -(-n // len(calls)) * len(calls)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / n)
    return statistics.median(times)


def time_eager(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def row(op: str, shape: str, t_us: float, eager_us: float | None, base_us: float | None,
        nbytes: float, flops: float, kind: str, note: str = "") -> dict:
    floor = max(nbytes / BW, flops / PEAK[kind]) * 1e6
    return dict(op=op, shape=shape, us=t_us, eager_us=eager_us, torch_us=base_us,
                bytes=nbytes, flops=flops, floor_us=floor, ratio=t_us / floor, note=note)


# ----------------------------------------------------------------------------- fp8_linear
FP8_DECODE = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096),
              ("wo_b", 4096, 8192), ("shared_w1", 2048, 4096), ("idx_wq_b", 8192, 1024)]
FP8_PREFILL = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192)]
# Decode shapes whose tile plans (BN × split-K) --sweep times at M = 1 and 16.
FP8_SWEEP_DECODE = ("wq_a", "wq_b", "wo_b", "idx_wq_b")


def _fp8_inputs(M: int, N: int, K: int, ncopy: int):
    sets = []
    for _ in range(ncopy):
        w8 = (torch.randn(N, K, device=DEV) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        ws = torch.randint(115, 121, (N // 128, K // 128), device=DEV, dtype=torch.uint8)
        x = torch.randn(M, K, device=DEV).bfloat16()
        sets.append((x, w8, ws.view(torch.float8_e8m0fnu)))
    return sets


def bench_fp8(M: int, name: str, N: int, K: int, sweep: bool) -> tuple[dict, list]:
    wbytes = N * K + (N // 128) * (K // 128)
    sets = _fp8_inputs(M, N, K, copies_for(wbytes + M * K * 2))
    calls = [lambda s=s: td.fp8_linear(s[0], s[1], s[2], 128, torch.bfloat16) for s in sets]
    t = time_graph(calls)
    x, w8, ws = sets[0]
    eager = time_eager(lambda: td.fp8_linear(x, w8, ws, 128, torch.bfloat16))
    wbf = formats.dequant_fp8_block(w8, ws, 128).to(torch.bfloat16)
    base = time_eager(lambda: torch.nn.functional.linear(x, wbf))
    nbytes = wbytes + M * K * 2 + M * N * 2
    r = row("fp8_linear", f"{name} M={M} N={N} K={K}", t, eager, base, nbytes, 2 * M * N * K,
            "fp8", f"plan {asdict(td.pick_fp8_config(M, N, K, 128, x.device))}; torch = bf16 "
            "F.linear on a pre-dequantized weight")
    tried = []
    if sweep:
        if M <= 64:
            # Split-K is reduced inside the kernel (no extra launches): splits up to 16 are
            # worth timing where K has the blocks for them.
            cands = [td.Fp8GemmConfig(BM=max(16, triton.next_power_of_2(M)), BN=bn, split_k=sp,
                                      num_warps=4, num_stages=3)
                     for bn in (32, 64, 128) for sp in (1, 2, 4, 8, 16) if sp <= K // 128]
        else:
            cands = [td.Fp8GemmConfig(BM=bm, BN=bn, num_warps=nw, num_stages=st, fuse_quant=False)
                     for bm, bn, nw, st in ((64, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 5),
                                            (128, 128, 8, 3), (64, 256, 8, 3))]
        for cfg in cands:
            try:
                cc = [lambda s=s, c=cfg: td.fp8_linear_with_config(s[0], s[1], s[2], 128,
                                                                   torch.bfloat16, c)
                      for s in sets]
                tried.append((time_graph(cc, 1.5), asdict(cfg)))
            except Exception as e:  # a plan that does not compile/fit: report and go on
                tried.append((float("inf"), f"{asdict(cfg)}: {type(e).__name__}: {e}"[:200]))
    return r, tried


# ----------------------------------------------------------------------------- sparse_attn
def bench_attn(T: int, Ka: int, Kb: int, sweep: bool, records: bool = False
               ) -> tuple[dict, list]:
    """``records``: both sources are V4's 584-byte fp8 cache records (kv_cache_dtype "fp8",
    the GPU default), read in place; else bf16 rows."""
    H, d = 64, 512
    fmt = v4_kv_record(d, 64)
    row_bytes = fmt.record_bytes if records else d * 2
    per_set = T * (Ka + Kb) * row_bytes
    sets = []

    def pool(n: int) -> torch.Tensor | PackedRows:
        rows = torch.randn(n, d, device=DEV).bfloat16()
        return PackedRows(fmt.pack(rows), fmt) if records else rows

    for _ in range(copies_for(per_set)):
        q = torch.randn(T, H, d, device=DEV).bfloat16()
        kv_a = pool(max(4096, T * 8))
        kv_b = pool(max(65536, T * 64))
        idx_a = torch.randint(0, kv_a.shape[0], (T, Ka), device=DEV, dtype=torch.int32)
        idx_b = torch.randint(0, kv_b.shape[0], (T, Kb), device=DEV, dtype=torch.int32)
        sets.append((q, kv_a, idx_a, kv_b, idx_b))
    sink = torch.randn(H, device=DEV)
    sc = d ** -0.5
    calls = [lambda s=s: ta.sparse_attn(s[0], s[1], s[2], s[3], s[4], sink, sc) for s in sets]
    t = time_graph(calls)
    s0 = sets[0]
    eager = time_eager(lambda: ta.sparse_attn(*s0[:5], sink, sc))
    base = time_eager(lambda: torch_attn.sparse_attn(*s0[:5], sink, sc)) if T <= 256 else None
    nbytes = per_set + 2 * T * H * d * 2 + T * (Ka + Kb) * 4
    flops = 4 * T * H * (Ka + Kb) * d
    plan = ta.pick_attn_config(T, H, d, Ka + Kb, q.device, records=records, bf16=not records)
    r = row("sparse_attn", f"T={T} H={H} d={d} Ka={Ka} Kb={Kb}{' fp8' if records else ''}", t,
            eager, base, nbytes, flops, "bf16", f"plan {asdict(plan)}; torch = twin (fp32)")
    tried = []
    if sweep:
        if T <= 16 and records:
            plans = [dict(BH=16, BN=bn, num_warps=nw, num_stages=st, split_kv=sp)
                     for bn in (32, 64) for nw in (4, 8) for sp in (4, 8) for st in (1, 2)]
            plans.append(dict(BH=16, BN=64, num_warps=4, num_stages=2, split_kv=8,
                              chunked=False))  # the per-element record reads, as before
        elif T <= 16:
            plans = [dict(BH=16, BN=bn, num_warps=nw, num_stages=2, split_kv=sp)
                     for bn in (32, 64) for nw in (4, 8) for sp in (2, 4, 8, 16)]
        else:
            plans = [dict(BH=16, BN=64, num_warps=4, num_stages=2),
                     dict(BH=16, BN=64, num_warps=8, num_stages=2),
                     dict(BH=64, BN=32, num_warps=8, num_stages=2, dv=256),
                     dict(BH=64, BN=64, num_warps=8, num_stages=2, dv=128),
                     dict(BH=32, BN=64, num_warps=4, num_stages=2, dv=256),
                     dict(BH=64, BN=32, num_warps=8, num_stages=1),
                     # Fewer programs per token (each gathers and dequantizes the same rows):
                     dict(BH=32, BN=64, num_warps=8, num_stages=2),
                     dict(BH=32, BN=32, num_warps=8, num_stages=2),
                     dict(BH=32, BN=64, num_warps=8, num_stages=1),
                     dict(BH=16, BN=128, num_warps=8, num_stages=2),
                     dict(BH=16, BN=64, num_warps=8, num_stages=3),
                     # All 64 heads and the whole head dim, the gathers pipelined (21st
                     # session: the one-stage form waits for every step's rows):
                     dict(BH=64, BN=32, num_warps=8, num_stages=2),
                     dict(BH=64, BN=32, num_warps=8, num_stages=3),
                     dict(BH=64, BN=64, num_warps=8, num_stages=2),
                     dict(BH=64, BN=16, num_warps=8, num_stages=3),
                     # Both sources in one loop (22nd session: no spills; bf16 rows only).
                     dict(BH=64, BN=64, num_warps=8, num_stages=2, one_loop=True)]
            if T <= 64:
                plans += [dict(BH=16, BN=64, num_warps=4, num_stages=2, split_kv=2)]
        for plan in plans:
            cfg = ta.AttnConfig(**plan)
            try:
                cc = [lambda s=s, c=cfg: ta.sparse_attn_with_config(s[0], s[1], s[2], s[3], s[4],
                                                                    sink, sc, None, c)
                      for s in sets]
                tried.append((time_graph(cc, 1.5), asdict(cfg)))
            except Exception as e:
                tried.append((float("inf"), f"{asdict(cfg)}: {type(e).__name__}: {e}"[:200]))
    return r, tried


# ----------------------------------------------------------------------------- indexer
def bench_indexer(T: int, L: int) -> dict:
    h, dI = 64, 128
    per_set = T * L * dI * 2
    sets = []
    for _ in range(copies_for(per_set)):
        keys = torch.randn(max(L * 2, 65536), dI, device=DEV).bfloat16()
        q = torch.randn(T, h, dI, device=DEV).bfloat16()
        w = torch.randn(T, h, device=DEV)
        rows = torch.randint(0, keys.shape[0], (T, L), device=DEV)
        n_vis = torch.full((T,), L, device=DEV, dtype=torch.int64)
        sets.append((q, w, keys, rows, n_vis))
    calls = [lambda s=s: ta.indexer_scores(*s) for s in sets]
    t = time_graph(calls)
    eager = time_eager(lambda: ta.indexer_scores(*sets[0]))
    base = time_eager(lambda: torch_attn.indexer_scores(*sets[0])) if T * L <= 1 << 22 else None
    nbytes = per_set + T * h * dI * 2 + T * L * (4 + 8)
    return row("indexer_scores", f"T={T} h={h} dI={dI} L={L}", t, eager, base, nbytes,
               2 * T * h * L * dI, "bf16", "torch = twin (fp32)")


def bench_indexer_prefill(T: int, ratio: int = 4) -> dict:
    """The indexer scores of one request's prefill of T tokens from position 0 (every token
    repeats the request's key rows; token t sees (t + 1) // ratio entries), the keys as V4's
    fp4 records (kv_cache_dtype "fp8").  FLOPs and bytes count the visible entries only, the
    keys once per token (the kernel's gathers).  (A token-tile kernel gathering the keys once
    per 4 tokens was measured here: 1.25x faster alone, no faster in the 4-layer prefill;
    removed, the code is at commit b24ade3.)"""
    from dsv4.cache import formats as cf
    h, dI = 64, 128
    L = T // ratio
    f = cf.fp4_record(dI, cf.V4_INDEX_BLOCK, "e8m0")
    n_vis = (torch.arange(T, device=DEV) + 1) // ratio
    seen = int(n_vis.sum())
    sets = []
    for _ in range(copies_for(T * h * dI * 2 + T * L * 12)):
        keys = PackedRows(f.pack(torch.randn(4 * L, dI, device=DEV)), f)
        rows = torch.randperm(4 * L, device=DEV)[:L].expand(T, L).contiguous()
        q = torch.randn(T, h, dI, device=DEV).bfloat16()
        w = torch.randn(T, h, device=DEV) * (dI ** -0.5 * h ** -0.5)
        sets.append((q, w, keys, rows, n_vis))
    calls = [lambda s=s: ta.indexer_scores(*s) for s in sets]
    t = time_graph(calls)
    eager = time_eager(lambda: ta.indexer_scores(*sets[0]))
    nbytes = T * h * dI * 2 + T * L * (4 + 8) + seen * f.record_bytes
    return row("indexer_scores", f"prefill T={T} h={h} dI={dI} L={L} fp4", t, eager, None,
               nbytes, 2 * seen * h * dI, "bf16")


# ----------------------------------------------------------------------------- linear_fp32
# V4-Flash fp32 GEMMs: the compressors' wkv / wgate widths and the MoE gate (K = dim = 4096).
LINEAR32_SHAPES = [("cmp_r4_overlap", 1024, 4096), ("cmp_r128", 512, 4096),
                   ("cmp_indexer", 256, 4096), ("moe_gate", 256, 4096)]


def bench_linear32(T: int, name: str, N: int, K: int, sweep: bool) -> tuple[dict, list]:
    """``linear_fp32`` (fp32 weight, fp32 x) against cuBLAS fp32 ``F.linear`` with TF32 off."""
    from dsv4.ops import triton_linear32 as tl32
    wbytes = N * K * 4
    sets = [(torch.randn(T, K, device=DEV), torch.randn(N, K, device=DEV) * 0.02)
            for _ in range(copies_for(wbytes + T * K * 4))]
    calls = [lambda s=s: tl32.linear_fp32(s[0], s[1]) for s in sets]
    t = time_graph(calls)
    x, w = sets[0]
    eager = time_eager(lambda: tl32.linear_fp32(x, w))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        base = time_graph([lambda s=s: torch.nn.functional.linear(s[0], s[1]) for s in sets])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    nbytes = wbytes + T * K * 4 + T * N * 4
    plan = tl32.pick_linear32_config(T, N, K, x.device) if T <= tl32.MAX_KERNEL_ROWS else None
    r = row("linear_fp32", f"{name} T={T} N={N} K={K}", t, eager, base, nbytes, 2 * T * N * K,
            "fp32", f"plan {asdict(plan) if plan else 'twin'}; torch = fp32 F.linear, TF32 "
            "off (CUDA-graph time)")
    tried = []
    if sweep and plan is not None:
        bms = [plan.BM] if plan.BM >= 16 else [plan.BM, 16]
        cands = [tl32.Linear32Config(BM=bm, BN=bn, BK=bk, split_k=sp, num_warps=4,
                                     num_stages=3 if bm >= 16 else 2)
                 for bm in bms for bn in (32, 64, 128) for sp in (4, 8, 16, 32)
                 for bk in ((32, 64) if bm >= 16 else (max(8, min(128, 4096 // (bm * bn))),))]
        for cfg in cands:
            try:
                cc = [lambda s=s, c=cfg: tl32.linear_fp32_with_config(s[0], s[1], c)
                      for s in sets]
                tried.append((time_graph(cc, 1.5), asdict(cfg)))
            except Exception as e:  # a plan that does not compile/fit: report and go on
                tried.append((float("inf"), f"{asdict(cfg)}: {type(e).__name__}: {e}"[:200]))
    return r, tried


# The GPU model holds these weights in their checkpoint bf16 (fp32 math on exact bf16 values):
# stacked wkv + wgate widths and the gate, bf16 x as in the model.
LINEAR_BF16W_SHAPES = [("cmp_r4_kv_gate", 2048, 4096), ("cmp_r128_kv_gate", 1024, 4096),
                       ("cmp_indexer_kv_gate", 512, 4096), ("moe_gate", 256, 4096)]


def bench_linear_bf16w(T: int, name: str, N: int, K: int, sweep: bool,
                       wide: bool = False) -> tuple[dict, list]:
    """``linear_fp32`` on a bf16 weight (the kernel at every T) against the former fp32-weight
    path of the same math (``linear_fp32(x, w.float())``: x.float() + cuBLAS at 1 and 64 rows,
    the kernel at 2..16, bf16x3 at prefill rows)."""
    from dsv4.ops import triton_linear32 as tl32
    # Several weight copies so the replays stream from DRAM, not L2.
    n = copies_for(N * K * 4)
    ws = [(torch.randn(N, K, device=DEV) * 0.02).to(torch.bfloat16) for _ in range(n)]
    w32s = [w.float() for w in ws]
    x = torch.randn(T, K, device=DEV).to(torch.bfloat16)
    t = time_graph([lambda w=w: tl32.linear_fp32(x, w) for w in ws])
    base = time_graph([lambda w=w: tl32.linear_fp32(x, w) for w in w32s])
    w, w32 = ws[0], w32s[0]
    want = x.double() @ w32.double().T
    err = float((tl32.linear_fp32(x, w) - want).norm() / want.norm())
    r = row("linear_bf16w", f"{name} T={T} N={N} K={K}", t, None, base,
            N * K * 2 + T * K * 2 + T * N * 4, 2 * T * N * K, "bf16",
            f"rel err vs fp64 {err:.1e}; torch = the fp32-weight path (linear_fp32 on w.float())")
    cands: list = []
    if sweep and T <= 2 and wide:
        # --wide: 1-2 rows, more warps and longer K chunks (each thread's broadcast products
        # 8..64 fp32 per chunk), splits 2-16.
        cands = [tl32.Linear32Config(BM=T, BN=bn, BK=bk, split_k=sp, num_warps=warps,
                                     num_stages=2)
                 for bn in (16, 32, 64) for bk in (256, 512, 1024) for warps in (4, 8)
                 if 8 <= bn * bk // (32 * warps) <= 64 for sp in (2, 4, 8, 16) if sp * bk <= K]
    elif sweep and T <= tl32.MAX_KERNEL_ROWS:
        bm = 1 << max(0, (T - 1).bit_length())
        bm = bm if bm <= 4 else max(16, bm)
        bk = 64 if bm >= 16 else None
        cands = [tl32.Linear32Config(BM=bm, BN=bn, BK=bk or max(8, min(256, 8192 // (bm * bn))),
                                     split_k=sp, num_warps=4, num_stages=3 if bm >= 16 else 2)
                 for bn in (32, 64, 128) for sp in (2, 4, 8, 16, 32)]
    tried = []
    for cfg in cands:
        try:
            tried.append((time_graph([lambda c=cfg, w=w: tl32.linear_fp32_with_config(x, w, c)
                                      for w in ws], 1.5), asdict(cfg)))
        except Exception as e:
            tried.append((float("inf"), f"{asdict(cfg)}: {type(e).__name__}: {e}"[:200]))
    return r, tried


# Prefill (8,192 rows, bf16 x as in the model): the compressors' stacked wkv + wgate and the
# gate, through the bf16x3 tensor-core path against cuBLAS's fp32 GEMM.
LINEAR32_PREFILL = [("cmp_r4_overlap_kv_gate", 2048, 4096), ("cmp_r128_kv_gate", 1024, 4096),
                    ("cmp_indexer_kv_gate", 512, 4096), ("moe_gate", 256, 4096)]


def bench_linear32_prefill(T: int, name: str, N: int, K: int, sweep: bool
                           ) -> tuple[dict, list]:
    from dsv4.ops import triton_linear32 as tl32
    x = torch.randn(T, K, device=DEV).to(torch.bfloat16)
    w = torch.randn(N, K, device=DEV) * 0.02
    plan = tl32.pick_prefill_config(T, N, K)
    t = time_graph([lambda: tl32.linear_fp32_with_config(x, w, plan)])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = torch.nn.functional.linear(x.float(), w)
        base = time_graph([lambda: torch.nn.functional.linear(x.float(), w)])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    err = float((tl32.linear_fp32_with_config(x, w, plan) - want).norm() / want.norm())
    r = row("linear_fp32", f"{name} T={T} N={N} K={K} bf16x", t, None, base,
            N * K * 4 + T * K * 2 + T * N * 4, 2 * T * N * K, "bf16",
            f"bf16x3 plan {asdict(plan)}; rel err vs fp32 F.linear {err:.1e}; torch = fp32 "
            "F.linear of x.float(), TF32 off")
    tried = []
    if sweep:
        for bm, bn, bk, nw, st in ((128, 128, 64, 8, 3), (128, 64, 32, 4, 3),
                                   (64, 128, 32, 4, 3), (128, 256, 32, 8, 3),
                                   (128, 128, 32, 4, 4)):
            cfg = tl32.Linear32Config(BM=bm, BN=min(bn, max(16, N)), BK=bk, num_warps=nw,
                                      num_stages=st, bf16x3=True)
            try:
                tried.append((time_graph([lambda c=cfg: tl32.linear_fp32_with_config(x, w, c)],
                                         1.5), asdict(cfg)))
            except Exception as e:  # a plan that does not compile/fit: report and go on
                tried.append((float("inf"), f"{asdict(cfg)}: {type(e).__name__}: {e}"[:200]))
    return r, tried


# ----------------------------------------------------------------------------- mHC
def bench_hc(T: int) -> list[dict]:
    n, D = 4, 4096
    per_set = T * n * D * 2
    sets = []
    for _ in range(copies_for(per_set)):
        x = torch.randn(T, n, D, device=DEV).bfloat16()
        out = torch.randn(T, D, device=DEV).bfloat16()
        sets.append((x, out))
    fn = torch.randn(24, n * D, device=DEV) * 0.02
    scale = torch.rand(3, device=DEV) + 0.5
    base = torch.randn(24, device=DEV)
    post = torch.rand(T, n, device=DEV)
    comb = torch.rand(T, n, n, device=DEV)
    fh, sh, bh = torch.randn(n, n * D, device=DEV) * 0.02, torch.ones(1, device=DEV), torch.zeros(
        n, device=DEV)
    x0, out0 = sets[0]
    rows = []
    t = time_graph([lambda s=s: triton_mhc.hc_pre(s[0], fn, scale, base, 1e-6, 1e-6, 20) for s in sets])
    rows.append(row("hc_pre", f"T={T} n={n} D={D}", t,
                    time_eager(lambda: triton_mhc.hc_pre(x0, fn, scale, base, 1e-6, 1e-6, 20)),
                    time_eager(lambda: torch_dense.hc_pre(x0, fn, scale, base, 1e-6, 1e-6, 20)),
                    per_set + fn.numel() * 4 + T * D * 2, 2 * T * 24 * n * D, "fp32",
                    "x is read twice (mix pass + collapse pass)"))
    t = time_graph([lambda s=s: triton_mhc.hc_post(s[1], s[0], post, comb) for s in sets])
    rows.append(row("hc_post", f"T={T} n={n} D={D}", t,
                    time_eager(lambda: triton_mhc.hc_post(out0, x0, post, comb)),
                    time_eager(lambda: torch_dense.hc_post(out0, x0, post, comb)),
                    2 * per_set + T * D * 2, 2 * T * n * (n + 1) * D, "fp32"))
    t = time_graph([lambda s=s: triton_mhc.hc_head(s[0], fh, sh, bh, 1e-6, 1e-6) for s in sets])
    rows.append(row("hc_head", f"T={T} n={n} D={D}", t,
                    time_eager(lambda: triton_mhc.hc_head(x0, fh, sh, bh, 1e-6, 1e-6)),
                    time_eager(lambda: torch_dense.hc_head(x0, fh, sh, bh, 1e-6, 1e-6)),
                    per_set + fh.numel() * 4 + T * D * 2, 2 * T * n * n * D, "fp32"))
    return rows


def fmt(r: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:9.1f}"
    return (f"{r['op']:<15} {r['shape']:<42} {f(r['us'])} {f(r['eager_us'])} {f(r['torch_us'])} "
            f"{r['bytes'] / 1e6:10.2f} {r['flops'] / 1e9:10.2f} {r['floor_us']:9.2f} "
            f"{r['ratio']:6.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time tile-plan candidates")
    ap.add_argument("--out", default=None, help="write all rows (and sweeps) as JSON here")
    ap.add_argument("--only", default="", help="comma list of ops to run (default: all)")
    ap.add_argument("--attn-tokens", default="1,16,64,1024,4096",
                    help="sparse_attn: comma list of token counts")
    ap.add_argument("--attn-kb", type=int, default=512,
                    help="sparse_attn: rows a token from the second source (512: a CSA layer's "
                    "top-k; 64: an HCA layer's compressed entries at 8K tokens)")
    ap.add_argument("--attn-sources", default="rows,records",
                    help="sparse_attn: bf16 rows and/or fp8 records (comma list)")
    ap.add_argument("--wide", action="store_true", help="linear_bf16w: one row only, swept "
                    "over more warps and longer K chunks (with --sweep)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    only = set(filter(None, args.only.split(",")))
    torch.manual_seed(0)
    rows, sweeps = [], []

    def want(op: str) -> bool:
        return not only or op in only

    def add(r: dict, tried: list | None = None) -> None:
        rows.append(r)
        print(fmt(r), flush=True)
        if tried:
            tried.sort(key=lambda x: x[0])
            sweeps.append(dict(op=r["op"], shape=r["shape"], tried=tried))
            for t, c in tried[:3]:
                print(f"    sweep {t:9.1f} us  {c}", flush=True)

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    hdr = (f"{'op':<15} {'shape':<42} {'us':>9} {'eager_us':>9} {'torch_us':>9} {'MB':>10} "
           f"{'GFLOP':>10} {'floor_us':>9} {'ratio':>6}")
    print(hdr, flush=True)
    if want("fp8_linear"):
        for M in (1, 16, 64):
            for name, N, K in FP8_DECODE:
                swept = (M in (1, 16) and name in FP8_SWEEP_DECODE) or (M == 64 and name == "wq_a")
                add(*bench_fp8(M, name, N, K, args.sweep and swept))
        for name, N, K in FP8_PREFILL:
            add(*bench_fp8(4096, name, N, K, args.sweep))
    if want("sparse_attn"):
        attn_tokens = [int(t) for t in args.attn_tokens.split(",")]
        kinds = args.attn_sources.split(",")
        for records in [r for r, k in ((False, "rows"), (True, "records")) if k in kinds]:
            for T in attn_tokens:
                # (the bf16-row plans were swept in the first GPU session, again from 1,024
                # tokens in the twentieth; both from 128 in the twenty-second: the engine's steps
                # of up to 2,048 tokens, below DENSE_WIDE_MIN_T / RECORD_WIDE_MIN_T)
                swept = T in (1, 16, 64) or T >= 128
                add(*bench_attn(T, 128, args.attn_kb, args.sweep and swept, records))
    if want("indexer_scores"):
        for T, L in ((1, 8192), (1, 65536), (64, 8192), (4096, 1024)):
            add(bench_indexer(T, L))
        for T in (2048, 8192):
            add(bench_indexer_prefill(T))
    if want("hc"):
        for T in (1, 64, 4096):
            for r in bench_hc(T):
                add(r)
    if want("linear_fp32"):
        for T in (1, 16, 64):
            for name, N, K in LINEAR32_SHAPES:
                add(*bench_linear32(T, name, N, K, args.sweep and name != "moe_gate"))
        for name, N, K in LINEAR32_PREFILL:
            add(*bench_linear32_prefill(8192, name, N, K, True))
    if want("linear_bf16w"):
        for T in ((1,) if args.wide else (1, 4, 16, 64, 8192)):
            for name, N, K in LINEAR_BF16W_SHAPES:
                add(*bench_linear_bf16w(T, name, N, K, args.sweep and T in (1, 16), args.wide))
    print("\n" + hdr)
    for r in rows:
        print(fmt(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows, sweeps=sweeps), f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
