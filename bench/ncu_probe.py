"""One eager call each of the routed-expert kernels (MXFP4, 64 tokens) and of the FP8 GEMM (64
rows, wo_b), to run under Nsight Compute and read where their time goes (DRAM, shared memory,
ALU pipes, stalls):

    ncu --clock-control none -k regex:"_moe_up|_moe_down|_fp8_gemm" --launch-skip 3 \
        --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section WarpStateStats \
        python bench/ncu_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_decode import FLASH, mxfp4_stacks, routing  # noqa: E402

from dsv4.ops import triton_dense as td  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402


def main() -> int:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ex = mxfp4_stacks(FLASH["E"], FLASH["D"], FLASH["I"], gen, dev)
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    x = torch.randn(T, FLASH["D"], device=dev, generator=gen).bfloat16()
    ids, w = routing(T, FLASH["E"], FLASH["k"], gen, dev)
    w8 = (torch.randn(4096, 8192, device=dev) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.randint(115, 121, (32, 64), device=dev, dtype=torch.uint8)
    ws = ws.view(torch.float8_e8m0fnu)
    x2 = torch.randn(T, 8192, device=dev, generator=gen).bfloat16()
    for _ in range(2):   # warm-up (compiles), then the profiled calls
        tri.moe_experts(x, ids, w, ex, 10.0)
        td.fp8_linear(x2, w8, ws, 128, torch.bfloat16)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
