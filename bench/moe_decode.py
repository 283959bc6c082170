"""Routed-expert kernel path on the GPU: tile plans of the MXFP4 expert GEMMs
(``dsv4.ops.triton_moe.moe_experts_with_config``) and the routing plan (Triton kernel vs its
torch twin), timed as CUDA-graph replays at V4-Flash widths (D 4096, I 2048, 256 experts top-6),
official numerics (FP8 activations, act_block 128), bf16 compute.

    PYTHONPATH=. python bench/moe_decode.py [--tokens 1,16,64,256,8192] [--sweep] [--out f.json]
    PYTHONPATH=. python bench/moe_decode.py --dry-run [--sweep]    # the plans it would time
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/moe_decode.py --tiny   # CPU smoke run

Per token count it times the default plan (``pick_moe_config``) and, with ``--sweep``, the
alternative plans of :func:`sweep_plans` (25 distinct plans in all at V4-Flash widths: the tile
plans, and up to ``SPLIT_SWEEP_MAX_TOKENS`` tokens the K splits 1/2/4/8 of the up and of the down
GEMM on the default tiles).  One
graph holds ``--rotate`` calls on different routings (<= 256 tokens), so the weights of
consecutive calls differ and come from HBM, as in a real step.  Columns: µs per call, the floor
max(distinct experts' MXFP4 bytes / 4.29 TB/s, expert FLOPs / 1459 TFLOP/s), the ratio to it,
GB/s (distinct experts' bytes / time) where the floor is bandwidth-bound or TFLOP/s where it is
compute-bound (8192 tokens), the relative error against the torch twin (on the first
``TWIN_ROWS`` rows: rows are independent, so a subset is an exact check and keeps 8192 cheap)
and whether every output is finite.  The best plan per token count is marked and goes to the
JSON (``best``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402
from dsv4.ops.torch_dense import ExpertWeights  # noqa: E402

BW = 4.29e12          # device copy bandwidth of the lent H200 (shared/GPU.md)
PEAK_FP8 = 1459e12    # fp8 dense GEMM peak (the floor docs/PERFORMANCE.md uses for prefill)
FLASH = {"E": 256, "D": 4096, "I": 2048, "k": 6}
TINY = {"E": 8, "D": 256, "I": 128, "k": 2}
DEFAULT_TOKENS = "1,16,64,256,8192"
TINY_TOKENS = "1,4"
SMALL_MAX_TOKENS = 256          # up to here the decode plans (BM 16), beyond the prefill plans
TWIN_ROWS = 256                 # rows the torch twin checks (all of them up to 256 tokens)
TINY_SWEEP_PLANS = 3            # plans per token count in the interpreter (default + 2)
# Decode (BM 16): N tiles (BN_up, BN_down); 8 warps only with 128-wide tiles (a 16-row tile of
# 64 columns gives 8 warps too little work each).
SMALL_TILES = [(64, 128), (128, 128), (64, 64), (32, 64)]
# K splits timed on the default tiles up to this many tokens, one GEMM at a time (the other keeps
# the default's split): the up and down kernels add up, so each axis finds its best split.
SPLIT_SWEEP_MAX_TOKENS = 16
SPLITS = (1, 2, 4, 8)
DECODE_STAGES = (2, 4)
SMALL_WIDE_WARPS8 = [(64, 128), (128, 128)]
# Prefill (BN 128/128): (BM, warps, stages).  BM 128 only with 8 warps: the up GEMM's fp32
# accumulator (128 rows x 2·128 columns) over 4 warps would be 256 registers a thread.
LARGE_PLANS = [(64, 4, 3), (64, 8, 3), (64, 4, 2), (64, 8, 2), (128, 8, 3), (128, 8, 2),
               # 12-48 rows an expert (short prompts, mixed steps): smaller blocks, other depths
               (16, 4, 3), (32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 1)]


def mxfp4_stacks(E: int, D: int, inter: int, gen: torch.Generator, dev: str,
                 kchunk: bool = False) -> ExpertWeights:
    """Random MXFP4 stacks (int8 codes [E, N, K/2], e8m0 scales [E, N, K/32]), act_block 128;
    ``kchunk``: stored K-chunk-major with chunks of 128 (the model's layout on the GPU,
    ``ExpertWeights.kchunk``; random bytes either way)."""
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(-128, 128, (E, n, k // 2), generator=gen, device=dev, dtype=torch.int8)
        s = torch.randint(118, 123, (E, n, k // 32), generator=gen, device=dev)
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128, 128 if kchunk else 0)


def routing(T: int, E: int, k: int, gen: torch.Generator, dev: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k expert ids [T, k] and routing weights (summing to 1.5, as V4's scale)."""
    ids = torch.rand(T, E, generator=gen, device=dev).topk(k, dim=-1).indices
    w = torch.rand(T, k, generator=gen, device=dev) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def expert_bytes(D: int, inter: int) -> int:
    """MXFP4 bytes of one expert: three [N, K] matrices, 0.5 byte per code + 1 per 32 scales."""
    return 3 * (inter * D // 2 + inter * D // 32)


def sweep_plans(T: int, base: tri.MoeConfig, dim: int, inter: int) -> list[tri.MoeConfig]:
    """The plans timed at ``T`` tokens: ``base`` (the default plan) first, then the alternatives
    of its regime (decode <= ``SMALL_MAX_TOKENS`` tokens, prefill beyond) that fit the widths,
    without duplicates.  BK and (decode, but for ``DECODE_STAGES`` on its tiles) stages follow
    ``base``.  Up to
    ``SPLIT_SWEEP_MAX_TOKENS`` tokens, right after ``base``: its tiles with the up GEMM's K
    split in ``SPLITS`` (the down's as in ``base``), then the same for the down GEMM (splits
    above the K steps left out); the tile alternatives are unsplit."""
    if T <= 0:
        raise ValueError(f"sweep_plans: token count must be positive; found {T}")
    alts: list[tri.MoeConfig] = []
    if T <= SPLIT_SWEEP_MAX_TOKENS:
        alts += [dataclasses.replace(base, split_up=s) for s in SPLITS
                 if s <= dim // base.BK]
        alts += [dataclasses.replace(base, split_down=s) for s in SPLITS
                 if s <= inter // base.BK]
    if T <= SMALL_MAX_TOKENS:
        # Pipeline depth: 3 stages of the up kernel's w1 + w3 tiles hold its occupancy to 3
        # programs per SM (Nsight Compute, 64 tokens: shared-memory limited, 66% issue busy).
        alts += [dataclasses.replace(base, stages=s) for s in DECODE_STAGES if s != base.stages]
        for up, down in SMALL_TILES:
            for warps in (4, 8) if (up, down) in SMALL_WIDE_WARPS8 else (4,):
                alts.append(tri.MoeConfig(16, up, down, base.BK, warps, warps, base.stages))
    else:
        for bm, warps, stages in LARGE_PLANS:
            alts.append(tri.MoeConfig(bm, 128, 128, base.BK, warps, warps, stages))
    plans = [base]
    for p in alts:
        if p not in plans and p.BN_up <= inter and p.BN_down <= dim:
            plans.append(p)
    return plans


def plan_name(cfg: tri.MoeConfig) -> str:
    """Short name of a tile plan: BM, N tiles up/down, warps up/down, stages, and the K splits
    up/down when split."""
    split = (f" split {cfg.split_up}/{cfg.split_down}"
             if cfg.split_up > 1 or cfg.split_down > 1 else "")
    return (f"BM{cfg.BM} BN {cfg.BN_up}/{cfg.BN_down} w{cfg.warps_up}/{cfg.warps_down} "
            f"s{cfg.stages}{split}")


def per_call_seconds(fns: list[Callable[[], Any]], dev: str, replays: int) -> float:
    """Median seconds per call of ``fns`` (one graph replays them all in turn); off the GPU the
    median of plain calls (smoke runs only: interpreter times mean nothing)."""
    if dev != "cuda":
        times = []
        for _ in range(max(1, replays)):
            t0 = time.perf_counter()
            for f in fns:
                f()
            times.append((time.perf_counter() - t0) / len(fns))
        return statistics.median(times)
    from bench.flash_bench import graph_time

    # One graph replays every call in turn; the per-call time is its share.
    return graph_time(lambda: [f() for f in fns], replays) / len(fns)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (b the reference)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fmt_us(us: float) -> str:
    """Microseconds to print: one decimal at kernel scale, 3 significant digits below 10 µs
    (the toy floors of --tiny are nanoseconds)."""
    return f"{us:.1f}" if us >= 10 else f"{us:.3g}"


def _num(v: float) -> str:
    """A rate to print: whole numbers at GPU scale, 3 significant digits below 100."""
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _device(tiny: bool) -> str:
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cuda" if torch.cuda.is_available() and not interp else "cpu"
    if dev == "cpu" and not tiny:
        raise SystemExit("moe_decode: no CUDA device; use --tiny with TRITON_INTERPRET=1 (a "
                         "smoke run) or --dry-run")
    if dev == "cpu" and not interp:
        raise SystemExit("moe_decode: --tiny on CPU needs TRITON_INTERPRET=1 (the kernels run "
                         "in the interpreter)")
    return dev


def _time_plan(cfg: tri.MoeConfig, calls: list[tuple[torch.Tensor, ...]], ex: ExpertWeights,
               twin: torch.Tensor, dev: str, replays: int) -> dict[str, Any]:
    """One plan on the rotated calls: warm-up (compiles; an unbuildable plan fails here, before
    any graph capture), finite check of every output, twin check of the first call, timing."""
    fns = [lambda c=c: tri.moe_experts_with_config(c[0], c[1], c[2], ex, 10.0, cfg)
           for c in calls]
    try:
        outs = [f() for f in fns]
        res: dict[str, Any] = {
            "finite": all(bool(torch.isfinite(o).all()) for o in outs),
            "rel_twin": rel(outs[0][: twin.shape[0]], twin)}
        del outs
        res["us"] = per_call_seconds(fns, dev, replays) * 1e6
    except Exception as e:  # noqa: BLE001 - an unbuildable plan: report it, time the others
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    return res


def run(args: argparse.Namespace) -> dict:
    """Time the plans per token count, print the tables, return the results (see the module
    docstring); with ``args.out`` the JSON is rewritten after every token count."""
    dev = _device(args.tiny)
    shape = TINY if args.tiny else FLASH
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    tokens = parse_tokens(args.tokens, args.tiny)
    gen = torch.Generator(device=dev).manual_seed(0)
    ex = mxfp4_stacks(E, D, inter, gen, dev, kchunk=dev == "cuda")   # the model's GPU layout
    per_expert = expert_bytes(D, inter)
    # A smoke run: one call per timing (the interpreter takes seconds per kernel launch).
    replays = 1 if args.tiny else args.replays
    rotate = 1 if args.tiny else args.rotate
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                           "shape": shape, "sweep": args.sweep, "rotate": rotate, "rows": [],
                           "best": [], "plan": []}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))

    print(f"# routed experts, {out['device']}: E {E}, D {D}, I {inter}, top-{k}, MXFP4, "
          f"act_block 128, bf16 compute; CUDA-graph replay of {rotate} routings per graph "
          f"(<= {SMALL_MAX_TOKENS} tokens); twin on the first {TWIN_ROWS} rows")
    print("| tokens | plan | µs | floor µs | ratio | GB/s or TFLOP/s | rel err vs twin | "
          "finite |")
    print("|---|---|---|---|---|---|---|---|")
    for T in tokens:
        calls = []
        for _ in range(rotate if T <= SMALL_MAX_TOKENS else 1):
            x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
            ids, w = routing(T, E, k, gen, dev)
            calls.append((x, ids, w))
        distinct = statistics.mean(int(torch.unique(c[1]).numel()) for c in calls)
        nbytes = distinct * per_expert
        flops = 2 * 3 * D * inter * T * k
        compute_bound = flops / PEAK_FP8 > nbytes / BW
        floor_us = max(nbytes / BW, flops / PEAK_FP8) * 1e6
        x, ids, w = calls[0]
        n = min(T, TWIN_ROWS)
        twin = ref.moe_experts(x[:n], ids[:n], w[:n], ex, 10.0)
        base = tri.pick_moe_config(T * k, E, D, inter, 128)
        plans = sweep_plans(T, base, D, inter) if args.sweep else [base]
        if args.tiny:
            plans = plans[:TINY_SWEEP_PLANS]
        rows = []
        for cfg in plans:
            res = _time_plan(cfg, calls, ex, twin, dev, replays)
            res.update(T=T, plan=dataclasses.asdict(cfg), name=plan_name(cfg),
                       default=cfg == base, distinct=distinct, floor_us=floor_us)
            if "us" in res:
                res["ratio"] = res["us"] / floor_us
                res["GB_s"] = nbytes / res["us"] / 1e3
                res["TFLOP_s"] = flops / res["us"] / 1e6
            rows.append(res)
        timed = [r for r in rows if "us" in r and r["finite"]]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        for r in rows:
            name = r["name"] + (" (default)" if r["default"] else "")
            if r is best:
                name = f"**{name}** best"
            if "error" in r:
                print(f"| {T} | {name} | error: {r['error'][:80]} | {fmt_us(floor_us)} | | | | |")
                continue
            speed = (f"{_num(r['TFLOP_s'])} TFLOP/s" if compute_bound
                     else f"{_num(r['GB_s'])} GB/s")
            print(f"| {T} | {name} | {fmt_us(r['us'])} | {fmt_us(floor_us)} | {r['ratio']:.2f} | "
                  f"{speed} | {r['rel_twin']:.2e} | {r['finite']} |", flush=True)
        out["rows"].extend(rows)
        if best is not None:
            default_us = next((r["us"] for r in rows if r["default"] and "us" in r), None)
            out["best"].append({"T": T, "plan": best["plan"], "name": best["name"],
                                "us": best["us"], "default_us": default_us,
                                "speedup_vs_default": (default_us / best["us"]
                                                       if default_us else None)})
        save()

    print("\n| tokens | BM | plan kernel µs | plan torch twin µs | same output |")
    print("|---|---|---|---|---|")
    for T in tokens:
        ids, _ = routing(T, E, k, gen, dev)
        bm = tri.pick_moe_config(T * k, E, D, inter, 128).BM
        a = tri.moe_plan(ids, E, bm)
        b = tri.moe_plan_torch(ids, E, bm)
        same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        tk = per_call_seconds([lambda i=ids, b=bm: tri.moe_plan(i, E, b)], dev, replays) * 1e6
        tt = per_call_seconds([lambda i=ids, b=bm: tri.moe_plan_torch(i, E, b)], dev,
                              replays) * 1e6
        print(f"| {T} | {bm} | {fmt_us(tk)} | {fmt_us(tt)} | {same} |", flush=True)
        out["plan"].append({"T": T, "BM": bm, "kernel_us": tk, "torch_us": tt, "same": same})
    save()
    if dev != "cuda":
        print("\n(smoke run in the Triton interpreter: the times are not kernel times)")
    return out


def parse_tokens(spec: str | None, tiny: bool) -> list[int]:
    """Token counts from a comma-separated ``spec`` (None: the defaults of the mode)."""
    text = spec or (TINY_TOKENS if tiny else DEFAULT_TOKENS)
    try:
        tokens = [int(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"moe_decode: --tokens must be comma-separated integers; found {text!r}")
    if any(t < 1 for t in tokens):
        raise SystemExit(f"moe_decode: --tokens must be positive; found {text!r}")
    return tokens


def dry_run(args: argparse.Namespace) -> dict:
    """Print (and return) the plans each token count would time, without running anything."""
    shape = TINY if args.tiny else FLASH
    tokens = parse_tokens(args.tokens, args.tiny)
    print(f"moe_decode dry run: shape {shape}, tokens {tokens}, sweep "
          f"{'on' if args.sweep else 'off'}, plan kernel vs torch; per-expert MXFP4 bytes "
          f"{expert_bytes(shape['D'], shape['I'])}")
    plans: dict[int, list[str]] = {}
    for T in tokens:
        base = tri.pick_moe_config(T * shape["k"], shape["E"], shape["D"], shape["I"], 128)
        cfgs = sweep_plans(T, base, shape["D"], shape["I"]) if args.sweep else [base]
        if args.tiny:
            cfgs = cfgs[:TINY_SWEEP_PLANS]
        plans[T] = [plan_name(c) for c in cfgs]
        print(f"  T={T}: " + "; ".join(plans[T]) + "  (first: default)")
    distinct = {p for names in plans.values() for p in names}
    print(f"  {len(distinct)} distinct plans")
    return {"plans": plans, "distinct": len(distinct)}


def main(argv: list[str] | None = None) -> dict:
    """Command line entry (see the module docstring); returns the results (or the dry-run's
    plans)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--rotate", type=int, default=8,
                    help="routings per graph (different experts per call; <= 256 tokens)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the alternative tile plans per token count")
    ap.add_argument("--tiny", action="store_true", help="toy widths (CPU smoke run)")
    ap.add_argument("--dry-run", action="store_true", help="print the plans and exit")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    if args.rotate < 1 or args.replays < 1:
        raise SystemExit("moe_decode: --rotate and --replays must be >= 1")
    if args.dry_run:
        return dry_run(args)
    return run(args)


if __name__ == "__main__":
    main()
