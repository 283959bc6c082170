"""One eager call each of the 8K-token prefill glue kernels, to run under Nsight Compute and
read where their time goes (the mHC post + mixes launch at 485 µs on an H100 against ~200 µs of
bytes; the q head norm + RoPE in place):

    ncu --clock-control none -k regex:"_hc_post_mix|_norm_rope" --launch-skip 2 \
        --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats python bench/ncu_glue.py [T]

GPU only.  Two warm-up rounds (compiles), then one profiled round: hc_post_pre (V4-Flash:
n 4, D 4096, 24 mixes, the default prefill plan) and head_norm_rope ([T, 64, 512] in place).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv4.ops import triton_mhc, triton_norm  # noqa: E402

N, D, H, D_HEAD, HALF = 4, 4096, 64, 512, 32


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/ncu_glue.py needs a CUDA GPU", file=sys.stderr)
        return 2
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = (2 + N) * N
    out = torch.randn(T, D, device=dev, generator=g).bfloat16()
    x_res = torch.randn(T, N, D, device=dev, generator=g).bfloat16()
    post = torch.rand(T, N, device=dev, generator=g) * 2
    comb = torch.rand(T, N, N, device=dev, generator=g)
    comb = comb / comb.sum(1, keepdim=True)
    fn = torch.randn(rows, N * D, device=dev, generator=g) * 0.01
    scale = torch.ones(3, device=dev)
    base = torch.zeros(rows, device=dev)
    q = torch.randn(T, H, D_HEAD, device=dev, generator=g).bfloat16()
    ang = torch.rand(T, 1, device=dev, generator=g) * 6e4 * torch.logspace(0, -4, HALF, device=dev)
    cos, sin = torch.cos(ang), torch.sin(ang)
    plan = triton_mhc.pick_hc_plan("post_pre", T, N, D, torch.bfloat16)
    print("post_pre plan:", plan)
    for _ in range(3):
        triton_mhc.hc_post_pre(out, x_res, post, comb, fn, scale, base, 1e-6, 1e-6, 20)
        triton_norm.head_norm_rope(q, cos, sin, 1e-6, True, inplace=True)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
