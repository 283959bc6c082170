"""Prefill routed experts on FP8 tensor cores (``dsv4.ops.triton_moe_fp8.moe_experts_fp8mma``)
against the bf16-MMA kernels (``triton_moe.moe_experts_with_config``), V4-Flash widths (D 4096,
I 2048, 256 experts, top-6), MXFP4 stacks under official numerics (act_block 128), bf16.

    PYTHONPATH=. python bench/moe_prefill_fp8.py [--tokens 2048,8192] [--sweep] [--kept]
        [--out f.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/moe_prefill_fp8.py --tiny   # CPU smoke run

Per token count and FP8 weight mode (decoded in the GEMMs' K loop; predecoded): µs per call
(``triton.testing.do_bench``, median) and TFLOP/s (2·3·T·k·D·I FLOPs: the gate, up and down
GEMMs of every pick) of both paths, the speed-up, the relative difference of the outputs (the
FP8 path sums each 128-wide K step in the tensor core's reduced precision: ~3.7e-3 measured,
the GPU test's bound is 5e-3) and whether every output is finite; then the re-encoding of the
three stacks alone.  ``--sweep`` also times the other tile plans of :data:`SWEEP` and the
re-encoding tiles of :data:`PREDECODE_TILES`; ``--kept`` also the stacks with their FP8
re-encoding kept on the device (``ExpertWeights.fp8_codes``: nothing re-encoded per call).
The random stacks spread their scales by at most 4 per 128-wide step, inside the scale-folded
decode's limit (the row says ``fallback`` if not).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_decode import mxfp4_stacks  # noqa: E402

from dsv4.ops import triton_moe as tri  # noqa: E402
from dsv4.ops import triton_moe_fp8 as f8  # noqa: E402

FLASH = {"E": 256, "D": 4096, "I": 2048, "k": 6}
TINY = {"E": 4, "D": 256, "I": 128, "k": 2}
# The picks of both sizes and their neighbours that compile without register spills on sm_90
# (ptxas registers up / down, shared memory up / down; tests/kernels/sm90_cases.py compiles
# them all): the defaults first.
SWEEP = [f8.PLAN_SMALL,                                                          # 196/227, 72/57 KB
         f8.PLAN_LARGE,                                                          # 195/226, 72/80 KB
         f8.MoeFp8Config(BM=64, BN_up=128, BN_down=128, warps_up=8, warps_down=8,
                         stages=4),                                              # 196/122, 96/72 KB
         f8.MoeFp8Config(BM=64, BN_up=64, BN_down=128, warps_up=4, warps_down=4,
                         stages=4),                                              # 239/227, 64/74 KB
         f8.MoeFp8Config(BM=128, BN_up=64, BN_down=128, warps_up=8, warps_down=8,
                         stages=4),                                              # 195/226, 96/104 KB
         # For the predecoded weights (no decode registers): wider up tiles.
         f8.MoeFp8Config(BM=128, BN_up=128, BN_down=128, warps_up=8, warps_down=8, stages=3)]


# Re-encoding tiles timed by --sweep: (rows, K steps[, all loads first[, warps]]) of one
# _fp8_predecode_kernel program.
PREDECODE_TILES = [(64, 1), (32, 8), (32, 8, 1), (16, 16, 1), (64, 4, 1), (32, 16, 1),
                   (64, 8, 1, 8), (32, 8, 1, 8), (16, 8, 1), (128, 2, 1, 8)]


def time_us(fn: Callable[[], Any], device: str) -> float:
    """Median µs per call: ``triton.testing.do_bench`` on the GPU, wall clock in the CPU smoke
    run (meaningless as a speed, it only exercises the code)."""
    if device == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")) * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_setup(args: argparse.Namespace, name: str, tokens: str, tiny_tokens: str,
                experts: int = 0, rows: bool = False
                ) -> tuple[dict[str, int], str, list[int], torch.Generator, Any]:
    """What the expert benchmarks start from: (shape, device, token counts, generator, random
    MXFP4 stacks) — V4-Flash widths on the GPU (``experts`` routed experts if set), toy widths
    on the CPU under ``--tiny``; the stacks K-chunk-major on the GPU (the model's layout)
    unless ``rows``."""
    shape = dict(TINY if args.tiny else FLASH)
    if experts:
        shape["E"] = experts
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{name}: needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1)")
    counts = [int(t) for t in (args.tokens or (tiny_tokens if args.tiny else tokens)).split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    ex = mxfp4_stacks(shape["E"], shape["D"], shape["I"], gen, device,
                      kchunk=device == "cuda" and not rows)
    return shape, device, counts, gen, ex


def prepped(x: torch.Tensor, ids: torch.Tensor, E: int, BM: int, ab: int, order: int = 0
            ) -> dict[str, Any]:
    """An FP8-MMA expert call's plan (``BM``-row blocks) and its gathered activation's e4m3 codes /
    scales per ``ab`` columns (``_fp8_prep_kernel``, MMA order ``order``), for the benchmarks
    that time its GEMMs."""
    T, D = x.shape
    k = ids.shape[1]
    P = T * k
    pairs, block_expert = tri.moe_plan(ids.contiguous(), E, BM)
    nb = block_expert.shape[0]
    xq = torch.zeros(nb * BM, D, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.zeros(nb * BM, D // ab, dtype=torch.float32, device=x.device)
    f8._fp8_prep_kernel[(nb, D // ab)](x, pairs, block_expert, xq, xs, P, E, k, x.stride(0),
                                       xq.stride(0), xs.stride(0), GATHER=True, BM=BM, AB=ab,
                                       ORDER=order, num_warps=4)
    return {"pairs": pairs, "block_expert": block_expert, "xq": xq, "xs": xs, "P": P, "nb": nb}


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape, device, tokens, gen, ex = bench_setup(args, "moe_prefill_fp8", "2048,8192", "4,20",
                                                 rows=args.rows)
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    # The same stacks with their FP8 re-encoding kept on the device (the engine option
    # moe_fp8_codes): the GEMMs read it, nothing is re-encoded per call.
    kept = replace(ex, fp8_codes=f8.encode_fp8_codes(ex)) if args.kept else None
    rows: list[dict[str, Any]] = []
    print("| tokens | plan | weights | bf16-MMA µs | TFLOP/s | FP8-MMA µs | TFLOP/s | speed-up "
          "| rel. diff | finite |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T in tokens:
        x = torch.randn(T, D, generator=gen, device=device).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=gen, device=device).topk(k, dim=-1).indices
        w = torch.rand(T, k, generator=gen, device=device) + 0.1
        w = w / w.sum(-1, keepdim=True) * 1.5
        flops = 2 * 3 * T * k * D * inter
        y_bf16 = tri.moe_experts_with_config(x, ids, w, ex, 10.0, None)
        t_bf16 = time_us(lambda: tri.moe_experts_with_config(x, ids, w, ex, 10.0, None), device)
        modes = [("decoded in the K loop", False, ex), ("predecoded", True, ex)]
        if kept is not None:
            modes.append(("kept FP8 codes", True, kept))
        for mode, predecode, stacks in modes:
            picked = f8.pick_fp8mma_config(T * k, E, predecode)
            plans: list[f8.MoeFp8Config | None] = [None] + (
                [c for c in SWEEP if c != picked] if args.sweep else [])
            for cfg in plans:
                def call(cfg=cfg, predecode=predecode, stacks=stacks) -> torch.Tensor:
                    return f8.moe_experts_fp8mma(x, ids, w, stacks, 10.0, cfg,
                                                 predecode=predecode)
                y = call()
                t = time_us(call, device)
                used = cfg or picked
                name = (f"BM{used.BM} up {used.BN_up}/w{used.warps_up} down {used.BN_down}/"
                        f"w{used.warps_down} s{used.stages}" + (" (pick)" if cfg is None else ""))
                if not f8.fold_spread_ok(ex, f8.k_step(ex.act_block)):
                    name += " fallback"
                row = {"tokens": T, "plan": name, "weights": mode, "bf16_us": t_bf16,
                       "fp8_us": t, "bf16_tflops": flops / t_bf16 / 1e6,
                       "fp8_tflops": flops / t / 1e6, "speedup": t_bf16 / t,
                       "rel_diff": rel_diff(y, y_bf16), "finite": bool(torch.isfinite(y).all())}
                rows.append(row)
                print(f"| {T} | {name} | {mode} | {t_bf16:.0f} | {row['bf16_tflops']:.1f} | "
                      f"{t:.0f} | {row['fp8_tflops']:.1f} | {row['speedup']:.2f}x | "
                      f"{row['rel_diff']:.2e} | {row['finite']} |", flush=True)
    # The re-encoding alone (every expert of the three stacks, one chunk at a time): bytes read
    # (packed codes + scales) and written (e4m3 codes + fp32 step factors).
    ks = f8.k_step(ex.act_block)
    chunk = f8.predecode_chunk(E, inter, D)
    q1, q3, f1, f3 = f8._predecode_buffers(chunk, inter, D, ks, torch.device(device))
    asm = f8.FP8MMA_DECODE == "asm"
    kchunk = bool(ex.kchunk)   # the stacks' layout (the model's GPU default: K-chunk-major)

    (w1, s1, _), (w3, s3, _), (w2, s2, _) = (tri._weight_args(ex, n) for n in ("w1", "w3", "w2"))

    def predecode_all(tile: tuple[int, int] | None) -> None:
        for e0 in range(0, E, chunk):
            e1 = min(E, e0 + chunk)
            f8._predecode(w1, s1, q1, f1, e0, e1, asm, ks, tile, kchunk)
            f8._predecode(w3, s3, q3, f3, e0, e1, asm, ks, tile, kchunk)
            f8._predecode(w2, s2, q1.view(chunk, D, inter), f1.view(chunk, inter // ks, D),
                          e0, e1, asm, ks, tile, kchunk)

    moved = 3 * E * inter * D * (0.5 + 1 / 32 + 1 + 4 / ks)
    result_pre, by_tile = {}, []
    for tile in [None] + (PREDECODE_TILES if args.sweep else []):
        t_pre = time_us(lambda: predecode_all(tile), device)
        by_tile.append([list(tile or f8._PREDECODE_TILE), t_pre])
        name = "default" if tile is None else (f"{tile[0]} rows x {tile[1]} steps"
                                               + (" hoisted" if tile[2:3] == (1,) else "")
                                               + (f" {tile[3]} warps" if len(tile) > 3 else ""))
        result_pre[name] = t_pre
        print(f"predecode of the three stacks alone ({E} experts, {chunk} a chunk, tile "
              f"{name}): {t_pre:.0f} µs, {moved / t_pre / 1e3:.0f} GB/s", flush=True)
    t_pre = result_pre["default"]
    result = {"shape": shape, "device": device, "rows": rows, "predecode_us": t_pre,
              "predecode_tiles_us": result_pre,
              "predecode_by_tile": by_tile}   # [[rows, steps, ...], µs]: for DSV4_FP8MMA_PREDECODE_TILE
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry (see the module docstring); returns the results."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--sweep", action="store_true", help="also time the other FP8 tile plans")
    ap.add_argument("--rows", action="store_true",
                    help="row-major stacks (the layout before the twelfth session)")
    ap.add_argument("--kept", action="store_true",
                    help="also time the stacks with their FP8 re-encoding kept on the device")
    ap.add_argument("--tiny", action="store_true", help="toy widths on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
