"""The prefill expert GEMMs' program order (``triton_moe.N_FIRST``): row blocks first (the
default) against N tiles first, V4-Flash widths (D 4096, I 2048, top-6), MXFP4 stacks under
official numerics (act_block 128), bf16 activations.

    PYTHONPATH=. python bench/moe_order.py [--tokens 2048,8192] [--experts 256]
        [--paths "bf16-MMA,FP8-MMA re-encoded,FP8-MMA kept codes"] [--out f.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/moe_order.py --tiny   # CPU smoke run

Per token count and path — the bf16-MMA grouped kernels (``moe_experts_with_config``: what a
2K-token chunk runs), the FP8-MMA kernels with the weights re-encoded per call and with kept
FP8 codes (``moe_experts_fp8mma``: 8K tokens) — µs per call in both orders, timed alternately
(``triton.testing.do_bench`` medians, ``--reps`` rounds, the best of each), the ratio, and
whether both orders give the same bits (they must: each output tile's sums are unchanged).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_prefill_fp8 import bench_setup, time_us  # noqa: E402

from dsv4.ops import triton_moe as tri  # noqa: E402
from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape, device, tokens, gen, ex = bench_setup(args, "moe_order", "2048,8192", "4,20",
                                                 args.experts)
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    known = ["bf16-MMA", "FP8-MMA re-encoded", "FP8-MMA kept codes"]
    wanted = [p.strip() for p in args.paths.split(",")] if args.paths else known
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise SystemExit(f"moe_order: unknown paths {unknown}; known: {known}")
    # The kept FP8 codes (2× the stacks' bytes) only when that path is timed.
    kept = (replace(ex, fp8_codes=f8.encode_fp8_codes(ex)) if "FP8-MMA kept codes" in wanted
            else None)
    paths = {
        "bf16-MMA": lambda x, ids, w: tri.moe_experts_with_config(x, ids, w, ex, 10.0, None),
        "FP8-MMA re-encoded": lambda x, ids, w: f8.moe_experts_fp8mma(x, ids, w, ex, 10.0,
                                                                      predecode=True),
        "FP8-MMA kept codes": lambda x, ids, w: f8.moe_experts_fp8mma(x, ids, w, kept, 10.0,
                                                                      predecode=True),
    }
    paths = {p: paths[p] for p in wanted}
    rows: list[dict[str, Any]] = []
    print(f"{E} experts, D {D}, I {inter}, top-{k}; µs per call (best of {args.reps} "
          "alternating rounds)")
    print("| tokens | path | blocks first µs | N tiles first µs | ratio | same bits |")
    print("|---|---|---|---|---|---|")
    saved = tri.N_FIRST
    try:
        for T in tokens:
            x = torch.randn(T, D, generator=gen, device=device).to(torch.bfloat16)
            ids = torch.rand(T, E, generator=gen, device=device).topk(k, dim=-1).indices
            w = torch.rand(T, k, generator=gen, device=device) + 0.1
            w = w / w.sum(-1, keepdim=True) * 1.5
            for name, fn in paths.items():
                outs, best = {}, {0: float("inf"), 1: float("inf")}
                for _ in range(args.reps):
                    for order in (0, 1):
                        tri.N_FIRST = order
                        outs[order] = fn(x, ids, w)
                        best[order] = min(best[order], time_us(lambda: fn(x, ids, w), device))
                same = bool(torch.equal(outs[0], outs[1]))
                row = {"tokens": T, "path": name, "blocks_first_us": best[0],
                       "n_first_us": best[1], "ratio": best[1] / best[0], "same_bits": same}
                rows.append(row)
                print(f"| {T} | {name} | {best[0]:.0f} | {best[1]:.0f} | {row['ratio']:.3f} | "
                      f"{same} |", flush=True)
    finally:
        tri.N_FIRST = saved
    result = {"shape": shape, "device": device, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry (see the module docstring); returns the results."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--experts", type=int, default=0, help="routed experts (default 256)")
    ap.add_argument("--paths", default=None,
                    help="comma-separated paths to time (default: all three)")
    ap.add_argument("--reps", type=int, default=2, help="alternating timing rounds")
    ap.add_argument("--tiny", action="store_true", help="toy widths on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
