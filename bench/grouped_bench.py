"""Time ``grouped_dequant_linear`` (attn.wo_a kept FP8, dsv4.ops.triton_grouped) against the
bf16 einsum / bmm on the loader-dequantized weight (the former path) at V4-Flash shapes.

V4-Flash wo_a: G = 8 groups, N = o_lora 1024, K = 4096; FP8 weight 32 MiB + scales (bf16: 64
MiB).  Each variant is captured in a CUDA graph of ``--reps`` calls cycling over ``--copies``
weight copies (more than the 50 MB L2 together, as in a real step where other layers' weights
evict wo_a), replayed, timed with CUDA events; µs per call and the ratio to the bytes floor
(FP8 weight + scales + x + out bytes / 4.29e12 B/s, the H200's measured copy bandwidth) are
printed, plus the compute floor (2·T·G·N·K / 792e12 bf16 FLOP/s) where it dominates.

Variants: ``auto`` (the op's plan by T), ``kernel`` (the kernel with the plan it would pick
below DEQUANT_MIN_T, to place that threshold), ``dequant`` (bf16 temporary + torch bmm),
``bf16`` (the former einsum on a held bf16 weight).  ``--sweep`` adds alternative decode plans.

Run on the H200:  python bench/grouped_bench.py [--T 1,16,64,256,8192] [--sweep] [--block 32]
[--fp32-scales] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import triton_grouped as tg  # noqa: E402
from dsv4.ops.torch_grouped import grouped_dequant_linear as twin  # noqa: E402

BW = 4.29e12          # H200 device copy, B/s (docs/DESIGN.md)
BF16_FLOPS = 792e12   # bf16 dense GEMM, FLOP/s


def _weights(G: int, N: int, K: int, block: int, fp32: bool, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    w8 = (torch.randn(G * N, K, generator=gen, device="cuda") * 64).clamp(-448, 448)
    exps = torch.randint(114, 117, (G * N // block, K // block), generator=gen, device="cuda")
    s = (torch.exp2(exps.float() - 127) if fp32 else exps.to(torch.uint8).view(
        torch.float8_e8m0fnu))
    return w8.to(torch.float8_e4m3fn), s


def _time(fn: Callable[[int], torch.Tensor], copies: int, reps: int, replays: int) -> float:
    """µs per call of ``fn(i)`` (i = the weight copy), in a CUDA graph of ``reps`` calls."""
    for i in range(copies):          # warm-up: compiles, split-K counters, allocator pools
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for r in range(reps):
                fn(r % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", default="1,16,64,256,8192", help="token counts, comma separated")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--N", type=int, default=1024)
    p.add_argument("--K", type=int, default=4096)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--fp32-scales", action="store_true", help="float32 block scales (*-Base)")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time alternative decode plans")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("grouped_bench: needs a CUDA GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    G, N, K, B = a.groups, a.N, a.K, a.block
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [_weights(G, N, K, B, a.fp32_scales, gen) for _ in range(a.copies)]
    dense = [tg.dequant_weight(w8, s, B).view(G, N, K) for w8, s in ws]
    w_bytes = ws[0][0].numel() + ws[0][1].numel() * ws[0][1].element_size()
    print(f"# {torch.cuda.get_device_name()}  G={G} N={N} K={K} block={B} "
          f"scales={'fp32' if a.fp32_scales else 'e8m0'}  FP8 weight+scales {w_bytes / 2**20:.1f}"
          f" MiB, bf16 {G * N * K * 2 / 2**20:.1f} MiB; DEQUANT_MIN_T={tg.DEQUANT_MIN_T}")
    print(f"{'T':>6} {'variant':<44} {'us':>9} {'floor us':>9} {'x floor':>8}")
    rows = []
    dev = torch.device("cuda")
    for T in (int(t) for t in a.T.split(",")):
        x = torch.randn(T, G, K, generator=gen, device="cuda").to(torch.bfloat16)
        io = x.numel() * 2 + T * G * N * 2
        floor_fp8 = max((w_bytes + io) / BW, 2 * T * G * N * K / BF16_FLOPS) * 1e6
        floor_bf16 = max((G * N * K * 2 + io) / BW, 2 * T * G * N * K / BF16_FLOPS) * 1e6
        picked = tg.pick_grouped_plan(min(T, tg.DEQUANT_MIN_T - 1), G, N, K, B,
                                      not a.fp32_scales, dev)
        variants: list[tuple[str, Callable[[int], torch.Tensor], float]] = [
            ("auto", lambda i: tg.grouped_dequant_linear(x, *ws[i], B, G), floor_fp8),
            (f"kernel {picked}", lambda i: tg.grouped_dequant_linear_with_plan(
                x, *ws[i], B, G, picked), floor_fp8),
            ("dequant + bmm", lambda i: tg.grouped_dequant_linear_with_plan(
                x, *ws[i], B, G, "dequant"), floor_fp8),
            ("bf16 einsum (former path)", lambda i: torch.einsum("tgd,grd->tgr", x, dense[i]),
             floor_bf16),
        ]
        if a.sweep and T <= tg.DECODE_MAX_T:
            bk = picked.BK
            for bn, split, warps, after in ((64, 8, 4, True), (128, 4, 8, True),
                                            (128, 16, 8, True), (128, 8, 4, True),
                                            (256, 4, 8, True), (128, 8, 8, False)):
                after = after and picked.scale_after
                plan = tg.GroupedPlan(BM=picked.BM, BN=bn, BK=bk, split_k=split,
                                      num_warps=warps, num_stages=3, scale_after=after)
                variants.append((f"sweep {plan}", lambda i, plan=plan:
                                 tg.grouped_dequant_linear_with_plan(x, *ws[i], B, G, plan),
                                 floor_fp8))
        ref = twin(x, *ws[0], B, G).float()
        for name, fn, floor in variants:
            err = ((fn(0).float() - ref).norm() / ref.norm()).item()
            us = _time(fn, a.copies, a.reps, a.replays)
            rows.append(dict(T=T, variant=name, us=us, floor_us=floor, rel_err=err))
            print(f"{T:>6} {name[:44]:<44} {us:>9.1f} {floor:>9.1f} {us / floor:>8.2f}"
                  f"   rel err {err:.1e}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
