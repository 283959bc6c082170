"""Tile-plan sweep of the FP8 block-scaled GEMM (``dsv4.ops.triton_dense``) at decode batch
sizes, on the projections a V4-Flash decode step runs (one H200, CUDA-graph replay, weights
rotated past the 60 MB L2).

    PYTHONPATH=. python bench/fp8_decode_sweep.py [--rows 1,16,64,256] [--out sweep.json]

Per (rows M, shape) it prints the default plan's µs (``pick_fp8_config``), the best swept plan,
and both as a ratio to the weight-streaming floor (bytes / 4.29 TB/s).  Candidates: BN 64 / 128 /
256, K splits 1 / 2 / 4 / 8, 4 or 8 warps, 3 or 4 stages, and (M >= 16) the activation
quantized in the GEMM or in its own pass first (``fuse_quant``; the pass's time is included).

GEMV mode (the CUDA-core kernel for 1-4 rows, ``Fp8GemmConfig(gemv=True)``, off in
``pick_fp8_config`` until ``GEMV_MAX_M`` is set):

    PYTHONPATH=. python bench/fp8_decode_sweep.py --quick            # < ~60 s of GPU time
    PYTHONPATH=. python bench/fp8_decode_sweep.py --gemv [--sweep [--wide]] [--rows 1,2,4]
    PYTHONPATH=. python bench/fp8_decode_sweep.py --sass             # offline, no GPU

``--quick`` / ``--gemv`` time, at M = 1, 2, 4 on the five V4-Flash GEMMs of the task (wq_a+wkv,
wq_b, wo_b, shared w1+w3, w2), the default MMA plan against the default GEMV plan
(``pick_fp8_gemv_config``), both in µs and as a ratio to the bytes floor; ``--sweep`` also
times the GEMV candidates of :func:`gemv_candidates` (BN 16-128, BK 256-1024, K splits around
the default); ``DSV4_FP8_GEMV_SPLIT_ROWS=0`` times the per-row form of 2-4 rows.  ``--sass``
compiles the default GEMV plans for sm_90 and prints the SASS instruction counts of their K
loop, registers, and instructions per weight byte.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import BW, _fp8_inputs, copies_for, time_graph  # noqa: E402

from dsv4.ops import triton_dense as td  # noqa: E402

# (name, N, K) of the FP8 GEMMs of one V4-Flash decode step on one GPU (fused where the model
# fuses them: wq_a+wkv, shared w1+w3).
SHAPES = [("wq_a+wkv", 1536, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192),
          ("shared_w1+w3", 4096, 4096), ("shared_w2", 4096, 2048), ("idx_wq_b", 8192, 1024)]


def candidates(M: int, K: int) -> list[td.Fp8GemmConfig]:
    bm = max(16, triton.next_power_of_2(min(M, 64)))
    n_kb = K // 128
    out = []
    for fuse in ((True, False) if M >= 16 else (True,)):
        for bn in (64, 128, 256):
            for sp in (1, 2, 4, 8):
                if sp > n_kb:
                    continue
                for nw, st in ((4, 3), (4, 4), (8, 3)):
                    if bn == 256 and nw == 4 and bm >= 64:
                        continue  # 64×256 fp32 accumulator over 4 warps: 128 registers of acc
                    out.append(td.Fp8GemmConfig(BM=bm, BN=bn, split_k=sp, num_warps=nw,
                                                num_stages=st, fuse_quant=fuse))
    return out


# The five GEMMs the GEMV kernel targets (fused where the model fuses them).
GEMV_SHAPES = [("wq_a+wkv", 1536, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192),
               ("shared_w1+w3", 4096, 4096), ("shared_w2", 4096, 2048)]


def gemv_candidates(M: int, N: int, K: int, device: torch.device) -> list[td.Fp8GemmConfig]:
    """GEMV plans around the default: BN 16 / 32 / 64 / 128 (8 rows per thread: BN / 8 warps,
    and 64 rows on 4 warps), BK 256 / 512 / 1024, K splits at half, one and two times the
    default's (within the K steps)."""
    base = td.pick_fp8_gemv_config(M, N, K, 128, device)
    out = []
    for bn, warps in ((16, 2), (32, 4), (64, 8), (64, 4), (128, 8)):
        for bk in (256, 512, 1024):
            steps = max(1, K // bk)
            for sp in sorted({max(1, base.split_k // 2), base.split_k, base.split_k * 2}):
                if sp <= min(steps, 32):
                    out.append(td.Fp8GemmConfig(BM=base.BM, BN=bn, split_k=sp, num_warps=warps,
                                                num_stages=1, gemv=True, BK=bk))
    return out


def wide_gemv_candidates(M: int, N: int, K: int) -> list[td.Fp8GemmConfig]:
    """``--wide``: plans with more K per step and per program than :func:`gemv_candidates` —
    16 / 32-row tiles on 2-16 warps, K steps up to 4,096 columns, 1-4 splits — so that a
    program quantizes its activation step once per more weight bytes and fewer splits pay the
    split-K tail; and 8-row tiles for the small wq_a+wkv."""
    out = []
    tiles = ((16, 2), (16, 4), (16, 8), (32, 4), (32, 8), (32, 16))
    for bn, warps in ((8, 1), (8, 2)) + tiles if N <= 2048 else tiles:
        for bk in (512, 1024, 2048, 4096):
            if bk > K or bk // 16 * bn < 32 * warps:     # at least one 16-byte vector a lane
                continue
            for sp in (1, 2, 4):
                if sp <= K // bk:
                    out.append(td.Fp8GemmConfig(BM=triton.next_power_of_2(M), BN=bn,
                                                split_k=sp, num_warps=warps, num_stages=1,
                                                gemv=True, BK=bk))
    return out


def _plan(cfg: td.Fp8GemmConfig) -> str:
    if cfg.gemv:
        return f"gemv BN{cfg.BN} BK{cfg.BK} split{cfg.split_k} w{cfg.num_warps}"
    return f"mma BM{cfg.BM} BN{cfg.BN} split{cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}"


def run_gemv(rows: list[int], want: set[str], sweep: bool, out_path: str | None,
             wide: bool = False) -> int:
    """Default MMA plan against the default (and with ``sweep`` the best) GEMV plan; ``wide``:
    the sweep over :func:`wide_gemv_candidates`, and the grouped ``wo_a`` (8 groups of 1,024
    rows over 4,096 columns, bf16 x unquantized) too (its MMA column: nan)."""
    results = []
    print(f"{'shape':<14} {'M':>2} {'floor':>6} {'mma':>6} {'ratio':>5} {'gemv':>6} {'ratio':>5} "
          f"{'speedup':>7}  gemv plan{'  | best swept gemv' if sweep else ''}")
    shapes = GEMV_SHAPES + ([("wo_a (grouped)", 8 * 1024, 4096)] if wide else [])
    for M in rows:
        for name, N, K in shapes:
            if want and name not in want:
                continue
            grouped = name.startswith("wo_a")
            kx = 8 * K if grouped else K              # wo_a: x [M, 8 groups · K]
            wbytes = N * K + (N // 128) * (K // 128)
            sets = _fp8_inputs(M, N, K, copies_for(wbytes + M * kx * 2))
            if grouped:
                sets = [(torch.randn(M, kx, device=w8.device).bfloat16(), w8, ws)
                        for _, w8, ws in sets]
            dev = sets[0][0].device
            floor = (wbytes + M * kx * 2 + M * N * 2) / BW * 1e6
            mma = td.pick_fp8_config(M, N, K, 128, dev)
            if mma.gemv:    # GEMV_MAX_M set in the environment: time the MMA rule of M anyway
                saved, td.GEMV_MAX_M = td.GEMV_MAX_M, 0
                mma = td.pick_fp8_config(M, N, K, 128, dev)
                td.GEMV_MAX_M = saved
            gemv = td.pick_fp8_gemv_config(M, N, K, 128, dev)

            def call(s: tuple, cfg: td.Fp8GemmConfig) -> object:
                if grouped:
                    return td._fp8_gemv(s[0], s[1], s[2].view(torch.uint8), True, 128,
                                        torch.bfloat16, cfg, groups=8, quant_x=False)
                return td.fp8_linear_with_config(s[0], s[1], s[2], 128, torch.bfloat16, cfg)

            def timed(cfg: td.Fp8GemmConfig, target_ms: float = 3.0) -> float:
                return time_graph([lambda s=s: call(s, cfg) for s in sets], target_ms)

            t_mma = float("nan") if grouped else timed(mma)
            t_gemv = timed(gemv)
            line = (f"{name:<14} {M:>2} {floor:6.2f} {t_mma:6.1f} {t_mma / floor:5.2f} "
                    f"{t_gemv:6.1f} {t_gemv / floor:5.2f} {t_mma / t_gemv:7.2f}  {_plan(gemv)}")
            rec = dict(shape=name, M=M, N=N, K=K, floor_us=floor, mma_us=t_mma,
                       mma=asdict(mma), gemv_us=t_gemv, gemv=asdict(gemv))
            if sweep:
                tried = []
                for cfg in (wide_gemv_candidates(M, N, K) if wide
                            else gemv_candidates(M, N, K, dev)):
                    try:
                        tried.append((timed(cfg, 1.5), _plan(cfg)))
                    except Exception as e:  # noqa: BLE001 - a plan that fails: report, go on
                        tried.append((float("inf"), f"{_plan(cfg)}: {type(e).__name__}: {e}"))
                tried.sort(key=lambda t: t[0])
                line += f"  | {tried[0][0]:.1f} ({tried[0][0] / floor:.2f}) {tried[0][1]}"
                rec["tried"] = tried[:10]
            print(line, flush=True)
            results.append(rec)
            sets.clear()          # free this shape's weight copies before the next
            torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


def _loop_counts(cubin: bytes) -> tuple[int, collections.Counter, str]:
    """(instructions, opcode counts) of the longest backward-branch loop of a cubin's SASS, and
    the kernel's registers per thread."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    regs = (re.findall(r"REG:(\d+)", res) or ["?"])[0]
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           for m in [re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)] if m]
    back = [(a, int(t.group(1), 16)) for a, s in ins if "BRA" in s
            for t in [re.search(r"0x([0-9a-f]+)", s)] if t and int(t.group(1), 16) <= a]
    end, start = max(back, key=lambda p: p[0] - p[1])
    body = [s for a, s in ins if start <= a <= end]
    return len(body), collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", s).split()[0].split(".")[0] for s in body), regs


def run_sass() -> int:
    """Offline: the K-loop SASS of the default GEMV plans (V4-Flash, 132 SMs) for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    td.sm_count = lambda device: 132
    fn = td._fp8_gemv_kernel
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "sw_ptr": "*u8", "out_ptr": "*bf16",
            "ws_ptr": "*fp32", "count_ptr": "*i32"}
    seen = set()
    for M in (1, 2, 4):
        for name, N, K in GEMV_SHAPES:
            cfg = td.pick_fp8_gemv_config(M, N, K, 128, torch.device("cpu"))
            key = (cfg.BM, cfg.BN, cfg.BK, cfg.num_warps)
            if key in seen:
                continue
            seen.add(key)
            consts = dict(SW_E8M0=True, B=128, MP=cfg.BM, BN=cfg.BN, BK=cfg.BK,
                          SPLITS=max(2, cfg.split_k), SPLIT_ROWS=td.GEMV_SPLIT_ROWS)
            sig, attrs = {}, {}
            for i, n in enumerate(fn.arg_names):
                sig[n] = "constexpr" if n in consts else ptrs.get(n, "i32")
                # The divisibility a real launch gets (else the loads are not vectorized).
                if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "n_kb"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
            src = ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs={
                (fn.arg_names.index(k),): v for k, v in consts.items()})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=cfg.num_warps, num_stages=1))
            n, ops, regs = _loop_counts(k.asm["cubin"])
            vectors = cfg.BN * cfg.BK // 16 // (32 * cfg.num_warps)   # 16-byte W loads/thread
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(10))
            print(f"M<={cfg.BM} BN{cfg.BN} BK{cfg.BK} w{cfg.num_warps} ({name}, {regs} regs): {n} "
                  f"instr per "
                  f"K step, {vectors} W vectors/thread, {n / vectors / 16:.2f} instr per weight "
                  f"byte | {top}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=None, help="default 1,16,64,256 (--gemv / --quick: 1,2,4)")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gemv", action="store_true", help="MMA against GEMV plans at 1-4 rows")
    ap.add_argument("--quick", action="store_true", help="--gemv, default plans only")
    ap.add_argument("--sweep", action="store_true", help="with --gemv: time the GEMV candidates")
    ap.add_argument("--sass", action="store_true", help="offline SASS counts of the GEMV plans")
    ap.add_argument("--wide", action="store_true", help="with --gemv --sweep: the wide plan "
                    "set (more K per step and program) and the grouped wo_a")
    args = ap.parse_args()
    if args.sass:
        return run_sass()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    want = set(filter(None, args.shapes.split(",")))
    if args.gemv or args.quick:
        rows = [int(v) for v in (args.rows or "1,2,4").split(",")]
        return run_gemv(rows, want, args.sweep and not args.quick, args.out, args.wide)
    args.rows = args.rows or "1,16,64,256"
    results = []
    print(f"{'shape':<14} {'M':>4} {'floor':>7} {'default':>8} {'ratio':>6} {'best':>8} "
          f"{'ratio':>6}  best plan")
    for M in [int(v) for v in args.rows.split(",")]:
        for name, N, K in SHAPES:
            if want and name not in want:
                continue
            wbytes = N * K + (N // 128) * (K // 128)
            sets = _fp8_inputs(M, N, K, copies_for(wbytes + M * K * 2))
            floor = (wbytes + M * K * 2 + M * N * 2) / BW * 1e6
            dflt_cfg = td.pick_fp8_config(M, N, K, 128, sets[0][0].device)
            t_def = time_graph([lambda s=s: td.fp8_linear(s[0], s[1], s[2], 128, torch.bfloat16)
                                for s in sets])
            tried = []
            for cfg in candidates(M, K):
                try:
                    calls = [lambda s=s, c=cfg: td.fp8_linear_with_config(
                        s[0], s[1], s[2], 128, torch.bfloat16, c) for s in sets]
                    tried.append((time_graph(calls, 1.5), asdict(cfg)))
                except Exception as e:  # noqa: BLE001 - a plan that does not compile: go on
                    tried.append((float("inf"), f"{asdict(cfg)}: {type(e).__name__}"))
            tried.sort(key=lambda x: x[0])
            best_t, best = tried[0]
            print(f"{name:<14} {M:>4} {floor:7.2f} {t_def:8.1f} {t_def / floor:6.2f} "
                  f"{best_t:8.1f} {best_t / floor:6.2f}  {best}", flush=True)
            results.append(dict(shape=name, M=M, N=N, K=K, floor_us=floor, default_us=t_def,
                                default=asdict(dflt_cfg), tried=tried[:8]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
