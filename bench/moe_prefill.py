"""Prefill expert path on the GPU: the grouped-GEMM route (`moe_experts_grouped`: dequantize each
MXFP4 expert once, cuBLAS grouped GEMMs) against the in-kernel-dequant grouped kernel, at
V4-Flash widths (D 4096, I 2048, 256 experts, top-6).  Prints agreement and time per call.

    PYTHONPATH=. python bench/moe_prefill.py [--tokens 2048,8192]
"""

from __future__ import annotations

import argparse

import torch

from dsv4.ops import triton_moe as tri
from dsv4.ops.torch_dense import ExpertWeights


def mxfp4_stacks(E: int, D: int, inter: int, gen: torch.Generator) -> ExpertWeights:
    """Random MXFP4 stacks: packed e2m1 int8 [E, N, K/2] with e8m0 scales [E, N, K/32]."""
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(-128, 128, (E, n, k // 2), generator=gen, device="cuda",
                          dtype=torch.int8)
        s = torch.randint(118, 123, (E, n, k // 32), generator=gen, device="cuda")
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128)


def timed(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="2048,8192")
    args = ap.parse_args()
    E, D, inter, k = 256, 4096, 2048, 6
    gen = torch.Generator(device="cuda").manual_seed(0)
    ex = mxfp4_stacks(E, D, inter, gen)
    print("| tokens | in-kernel dequant ms | grouped GEMM ms | speed-up | rel. diff | finite |")
    print("|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
        ids = torch.rand(T, E, generator=gen, device="cuda").topk(k, dim=-1).indices
        w = torch.rand(T, k, generator=gen, device="cuda") + 0.1
        w = w / w.sum(-1, keepdim=True) * 1.5
        a = tri.moe_experts_with_config(x, ids, w, ex, 10.0, None)
        b = tri.moe_experts_grouped(x, ids, w, ex, 10.0)
        rel = ((a - b).norm() / a.norm()).item()
        ta = timed(lambda: tri.moe_experts_with_config(x, ids, w, ex, 10.0, None))
        tb = timed(lambda: tri.moe_experts_grouped(x, ids, w, ex, 10.0))
        print(f"| {T} | {ta:.2f} | {tb:.2f} | {ta / tb:.2f}x | {rel:.2e} | "
              f"{bool(torch.isfinite(b).all())} |", flush=True)


if __name__ == "__main__":
    main()
