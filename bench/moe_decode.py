"""Routed-expert decode path on the GPU: the MXFP4 GEMM variants (``MoeConfig.fp4_path``
"dequant" vs "group_scaled") and the routing plan (Triton kernel vs its torch twin), timed as
CUDA-graph replays at V4-Flash widths (D 4096, I 2048, 256 experts top-6), official numerics
(FP8 activations, act_block 128), bf16 compute.

    PYTHONPATH=. python bench/moe_decode.py [--tokens 1,16,64,256,8192] [--sweep] [--out f.json]
    PYTHONPATH=. python bench/moe_decode.py --dry-run              # what it would run
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/moe_decode.py --tiny   # CPU smoke run

Per token count it prints: µs per call of each path (one graph holds ``--rotate`` calls on
different routings, so the weights of consecutive calls differ and come from HBM, as in a real
step), effective GB/s (distinct experts' MXFP4 bytes / time), the ratio to the floor
(max(distinct experts' MXFP4 bytes / 4.29 TB/s, expert FLOPs / 1459 TFLOP/s)), and the agreement
of the two paths with each other and with the torch twin (relative error, finite).  ``--sweep``
also times N-tile plans at the small token counts (more programs for 132 SMs at B = 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.ops import torch_dense as ref  # noqa: E402
from dsv4.ops import triton_moe as tri  # noqa: E402
from dsv4.ops.torch_dense import ExpertWeights  # noqa: E402

BW = 4.29e12          # device copy bandwidth of the lent H200 (shared/GPU.md)
PEAK_FP8 = 1459e12    # fp8 dense GEMM peak (the floor docs/PERFORMANCE.md uses for prefill)
FLASH = {"E": 256, "D": 4096, "I": 2048, "k": 6}
TINY = {"E": 8, "D": 256, "I": 128, "k": 2}
SWEEP = [(64, 128), (32, 64), (32, 32), (16, 32)]     # (BN_up, BN_down) at BM 16


def mxfp4_stacks(E: int, D: int, inter: int, gen: torch.Generator, dev: str) -> ExpertWeights:
    """Random MXFP4 stacks (int8 codes [E, N, K/2], e8m0 scales [E, N, K/32]), act_block 128."""
    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(-128, 128, (E, n, k // 2), generator=gen, device=dev, dtype=torch.int8)
        s = torch.randint(118, 123, (E, n, k // 32), generator=gen, device=dev)
        return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, D), stack(inter, D), stack(D, inter)
    return ExpertWeights(w1, w3, w2, 128, "fp4", s1, s3, s2, 128)


def routing(T: int, E: int, k: int, gen: torch.Generator, dev: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(T, E, generator=gen, device=dev).topk(k, dim=-1).indices
    w = torch.rand(T, k, generator=gen, device=dev) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 1.5


def expert_bytes(D: int, inter: int) -> int:
    """MXFP4 bytes of one expert: three [N, K] matrices, 0.5 byte per code + 1 per 32 scales."""
    return 3 * (inter * D // 2 + inter * D // 32)


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
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def with_path(cfg: tri.MoeConfig, path: str, bn: tuple[int, int] | None = None
              ) -> tri.MoeConfig:
    up, down = bn if bn else (cfg.BN_up, cfg.BN_down)
    return tri.MoeConfig(cfg.BM, up, down, cfg.BK, cfg.warps_up, cfg.warps_down, cfg.stages,
                         fp4_path=path)


def run(args: argparse.Namespace) -> dict:
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
        else "cpu"
    if dev == "cpu" and not args.tiny:
        raise SystemExit("moe_decode: no CUDA device; use --tiny with TRITON_INTERPRET=1 (a "
                         "smoke run) or --dry-run")
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("moe_decode: --tiny on CPU needs TRITON_INTERPRET=1 (the kernels run "
                         "in the interpreter)")
    shape = TINY if args.tiny else FLASH
    E, D, inter, k = shape["E"], shape["D"], shape["I"], shape["k"]
    tokens = [int(t) for t in (args.tokens or ("1,4" if args.tiny else "1,16,64,256,8192"))
              .split(",")]
    gen = torch.Generator(device=dev).manual_seed(0)
    ex = mxfp4_stacks(E, D, inter, gen, dev)
    per_expert = expert_bytes(D, inter)
    # A smoke run: one call per timing (the interpreter takes seconds per kernel launch).
    replays = 1 if args.tiny else args.replays
    if args.tiny:
        args.rotate = 1
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                           "shape": shape, "rows": [], "plan": [], "sweep": []}
    print(f"# routed experts, {out['device']}: E {E}, D {D}, I {inter}, top-{k}, MXFP4, "
          f"act_block 128, bf16 compute; CUDA-graph replay of {args.rotate} routings per graph")
    print("| tokens | distinct experts | floor µs | dequant µs | group_scaled µs | speed-up | "
          "dequant GB/s | group_scaled GB/s | ratio to floor (dq / gs) | rel gs-dq | "
          "rel gs-twin | finite |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T in tokens:
        rot = max(1, args.rotate if T <= 256 else 1)
        calls = []
        for r in range(rot):
            x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
            ids, w = routing(T, E, k, gen, dev)
            calls.append((x, ids, w))
        distinct = statistics.mean(int(torch.unique(c[1]).numel()) for c in calls)
        nbytes = distinct * per_expert
        flops = 2 * 3 * D * inter * T * k
        floor = max(nbytes / BW, flops / PEAK_FP8)
        base = tri.pick_moe_config(T * k, E, D, inter, 128)
        res: dict[str, Any] = {"T": T, "distinct": distinct, "floor_us": floor * 1e6,
                               "base_plan": base.__dict__}
        outs = {}
        for path in ("dequant", "group_scaled"):
            cfg = with_path(base, path)
            fns = [lambda c=c, cfg=cfg: tri.moe_experts_with_config(c[0], c[1], c[2], ex, 10.0,
                                                                    cfg) for c in calls]
            outs[path] = fns[0]()
            res[path + "_us"] = per_call_seconds(fns, dev, replays) * 1e6
        x, ids, w = calls[0]
        twin = ref.moe_experts(x, ids, w, ex, 10.0) if T <= 2048 or dev == "cuda" else None
        res["rel_gs_dq"] = rel(outs["group_scaled"], outs["dequant"])
        res["rel_gs_twin"] = rel(outs["group_scaled"], twin) if twin is not None else None
        res["rel_dq_twin"] = rel(outs["dequant"], twin) if twin is not None else None
        res["finite"] = all(bool(torch.isfinite(o).all()) for o in outs.values())
        dq, gs = res["dequant_us"], res["group_scaled_us"]
        twin_s = f"{res['rel_gs_twin']:.2e}" if twin is not None else "–"
        print(f"| {T} | {distinct:.1f} | {floor * 1e6:.1f} | {dq:.1f} | {gs:.1f} | "
              f"{dq / gs:.2f}x | {nbytes / dq / 1e3:.0f} | {nbytes / gs / 1e3:.0f} | "
              f"{dq / (floor * 1e6):.2f} / {gs / (floor * 1e6):.2f} | {res['rel_gs_dq']:.2e} | "
              f"{twin_s} | {res['finite']} |", flush=True)
        out["rows"].append(res)

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
        print(f"| {T} | {bm} | {tk:.1f} | {tt:.1f} | {same} |", flush=True)
        out["plan"].append({"T": T, "BM": bm, "kernel_us": tk, "torch_us": tt, "same": same})

    if args.sweep:
        print("\n| tokens | path | BN_up/BN_down | µs |")
        print("|---|---|---|---|")
        for T in [t for t in tokens if t <= 16]:
            calls = []
            for r in range(max(1, args.rotate)):
                x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
                ids, w = routing(T, E, k, gen, dev)
                calls.append((x, ids, w))
            base = tri.pick_moe_config(T * k, E, D, inter, 128)
            for path in ("dequant", "group_scaled"):
                for bn in SWEEP[:2] if args.tiny else SWEEP:
                    if bn[0] > inter or bn[1] > D:
                        continue
                    cfg = with_path(base, path, bn)
                    fns = [lambda c=c, cfg=cfg: tri.moe_experts_with_config(
                        c[0], c[1], c[2], ex, 10.0, cfg) for c in calls]
                    try:
                        us = per_call_seconds(fns, dev, replays) * 1e6
                    except Exception as e:  # an out-of-resources plan: report, go on
                        out["sweep"].append({"T": T, "path": path, "bn": bn, "error": str(e)})
                        print(f"| {T} | {path} | {bn[0]}/{bn[1]} | error: {str(e)[:60]} |")
                        continue
                    out["sweep"].append({"T": T, "path": path, "bn": bn, "us": us})
                    print(f"| {T} | {path} | {bn[0]}/{bn[1]} | {us:.1f} |", flush=True)
    if dev != "cuda":
        print("\n(smoke run in the Triton interpreter: the times are not kernel times)")
    return out


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--rotate", type=int, default=8,
                    help="routings per graph (different experts per call; <= 256 tokens)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time N-tile plans at <= 16 tokens")
    ap.add_argument("--tiny", action="store_true", help="toy widths (CPU smoke run)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    if args.rotate < 1 or args.replays < 1:
        raise SystemExit("moe_decode: --rotate and --replays must be >= 1")
    if args.dry_run:
        shape = TINY if args.tiny else FLASH
        tokens = args.tokens or ("1,4" if args.tiny else "1,16,64,256,8192")
        print(f"moe_decode dry run: shape {shape}, tokens {tokens}, paths dequant / "
              f"group_scaled, plan kernel vs torch, sweep {SWEEP if args.sweep else 'off'}; "
              f"per-expert MXFP4 bytes {expert_bytes(shape['D'], shape['I'])}")
        for T in (int(t) for t in tokens.split(",")):
            cfg = tri.pick_moe_config(T * shape["k"], shape["E"], shape["D"], shape["I"], 128)
            print(f"  T={T}: {cfg}")
        return None
    out = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
