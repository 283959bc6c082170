"""A few eager calls of the prefill sparse attention over bf16 rows (V4-Flash CSA shapes: 64
heads × 512, 128 window + 512 compressed rows a token, the default plan for the token count),
to run under Nsight Compute and read where its time goes (shared memory, L2, tensor pipe,
stalls):

    ncu --clock-control none -k regex:"_sparse_attn" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python bench/ncu_attn.py 4096
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import triton_attn as ta  # noqa: E402


def main() -> int:
    dev = "cuda"
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    g = torch.Generator(device=dev).manual_seed(0)
    H, d, Ka, Kb = 64, 512, 128, 512
    q = torch.randn(T, H, d, device=dev, generator=g).bfloat16()
    kv_a = torch.randn(max(4096, 8 * T), d, device=dev, generator=g).bfloat16()
    kv_b = torch.randn(max(65536, 64 * T), d, device=dev, generator=g).bfloat16()
    idx_a = torch.randint(0, kv_a.shape[0], (T, Ka), device=dev, dtype=torch.int32, generator=g)
    idx_b = torch.randint(0, kv_b.shape[0], (T, Kb), device=dev, dtype=torch.int32, generator=g)
    sink = torch.randn(H, device=dev, generator=g)
    print("plan", ta.pick_attn_config(T, H, d, Ka + Kb, q.device, bf16=True))
    for _ in range(4):   # two warm-up calls (compile), then the profiled ones
        ta.sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, d ** -0.5)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
