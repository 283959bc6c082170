"""Tile-plan sweep of the FP8 block-scaled GEMM (``dsv4.ops.triton_dense``) at decode batch
sizes, on the projections a V4-Flash decode step runs (one H200, CUDA-graph replay, weights
rotated past the 60 MB L2).

    PYTHONPATH=. python bench/fp8_decode_sweep.py [--rows 1,16,64,256] [--out sweep.json]

Per (rows M, shape) it prints the default plan's µs (``pick_fp8_config``), the best swept plan,
and both as a ratio to the weight-streaming floor (bytes / 4.29 TB/s).  Candidates: BN 64 / 128 /
256, K splits 1 / 2 / 4 / 8, 4 or 8 warps, 3 or 4 stages, and (M >= 16) the activation
quantized in the GEMM or in its own pass first (``fuse_quant``; the pass's time is included).
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    want = set(filter(None, args.shapes.split(",")))
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
