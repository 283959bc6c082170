"""Time the fused decode glue of issue #5 against its torch twins on the GPU.

    PYTHONPATH=. python bench/index_records.py [--json out.json]

* ``indexer_queries`` (dsv4/ops/triton_index.py): the index queries' RoPE + Hadamard + FP4 fake
  quant + head weights after the wq_b / weights_proj GEMMs; V4-Flash (64 heads × 128, Hadamard)
  and V4.1-Flash (32 heads, no Hadamard), official numerics and bf16;
* ``write_records`` (dsv4/ops/triton_records.py): encode + scatter of the window rows into the
  ring (V4 584-byte records, V4.1 fp8 records), of compressed entries and of fp4 index keys.

Decode batches (1, 16, 64 rows) and a 2048-row prefill; each op is timed with CUDA events over
200 launches after a warm-up (mean µs per call), for the kernel and the torch twin (whose time
is dominated by its ~20-30 small kernel launches).  Needs a CUDA GPU; numbers not measured yet.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from dsv4.cache import formats as cf
from dsv4.ops import torch_index, torch_records, triton_index, triton_records


def _time_us(fn: Callable[[], Any], iters: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def bench_indexer_queries(rows: list[dict[str, Any]]) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    for model, H, hadamard in (("v4_flash", 64, True), ("v41_flash", 32, False)):
        for T in (1, 16, 64, 2048):
            q = torch.randn(T, H, 128, device=dev).to(bf16)
            w = torch.randn(T, H, device=dev).to(bf16)
            ang = torch.rand(T, 32, device=dev) * 100
            cos, sin = ang.cos(), ang.sin()
            for fp4 in (32, 0):
                args = (q, w, cos, sin, 128 ** -0.5 * H ** -0.5, hadamard, fp4)
                rows.append(dict(op="indexer_queries", model=model, T=T, fp4_block=fp4,
                                 kernel_us=_time_us(lambda a=args: triton_index.indexer_queries(*a)),
                                 twin_us=_time_us(lambda a=args: torch_index.indexer_queries(*a))))


def bench_write_records(rows: list[dict[str, Any]]) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    fmts = {"v4_window": cf.v4_kv_record(512, 64), "v41_window": cf.fp8_record(512, 32),
            "v41_latent": cf.fp4_record(512, 16, "e4m3"),
            "index_keys": cf.fp4_record(128, 32, "e8m0")}
    for name, fmt in fmts.items():
        pool = torch.zeros(64 * 128, fmt.record_bytes, dtype=torch.uint8, device=dev)
        for T in (1, 16, 64, 2048):
            n = min(T, pool.shape[0])
            x = torch.randn(n, fmt.dim, device=dev).to(bf16)
            dst = torch.randperm(pool.shape[0], device=dev)[:n]
            src = torch.arange(n, device=dev)
            args = (pool, dst, x, src, fmt)
            rows.append(dict(op="write_records", format=name, T=n,
                             kernel_us=_time_us(lambda a=args: triton_records.write_records(*a)),
                             twin_us=_time_us(lambda a=args: torch_records.write_records(*a))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/index_records.py needs a CUDA GPU")
    rows: list[dict[str, Any]] = []
    bench_indexer_queries(rows)
    bench_write_records(rows)
    for r in rows:
        what = r.get("model") or r.get("format")
        extra = f" fp4={r['fp4_block']}" if "fp4_block" in r else ""
        print(f"{r['op']:16s} {what:11s} T={r['T']:5d}{extra:8s} kernel {r['kernel_us']:8.1f} us"
              f"   twin {r['twin_us']:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
