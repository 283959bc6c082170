"""Does Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2``: one thread hands a byte range to
the TMA unit) make the batch-1 decode's weight streams faster?  (Sixteenth session; decides
whether the model issues ``moe_l2_prefetch`` after the routing and ``l2_bulk_prefetch`` of the
next GEMVs' weights.)

    PYTHONPATH=. python bench/l2_bulk.py [--out l2_bulk.json]

One H200, CUDA-graph replays of short sequences (``bench/kernels.py`` ``time_graph``); every
sequence starts by writing a 256 MB scratch buffer (evicts L2) and the flush's time is taken
off.  µs:

1. FP8 GEMVs of V4-Flash (M = 1, the model's plan): ``cold``; the bulk prefetch alone (the
   issuing kernel: it ends before the bytes arrive) for several program counts and piece
   sizes; the GEMV right after it and after a one-thread spin of a few µs (a stand-in for the
   latency-bound kernels before a GEMV in the step), each minus the prefetch and the spin.
2. The routed experts at one token (256 MXFP4 experts, K-chunk-major, top-6, 8 routings in
   turn): ``cold``; right after ``moe_l2_prefetch`` of the up stacks / of all stacks (minus
   the prefetch kernel); after a spin; with the evict-last policy.
3. The next layer's first GEMV (``wq_b``) after the experts, with and without its weight's
   bulk prefetch issued before the experts: whether a prefetch under the experts' stream pays
   and what it costs them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import BW, time_graph  # noqa: E402
from moe_decode import mxfp4_stacks, routing  # noqa: E402

from dsv4.ops import triton_dense as td  # noqa: E402
from dsv4.ops import triton_moe as tm  # noqa: E402
from dsv4.ops import triton_prefetch as tp  # noqa: E402

GEMVS = [("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("shared_w1+w3", 4096, 4096)]
CONFIGS = [(8, 16384), (32, 16384), (128, 16384), (32, 65536), (32, 4096)]   # (programs, chunk)
SPINS = (4000, 10000, 20000)     # torch.cuda._sleep cycles (~2, 5, 10 µs)


def seq_us(parts: list[Callable[[], object]]) -> float:
    """Median µs of one pass over ``parts`` (CUDA-graph replays)."""
    return time_graph([lambda: [f() for f in parts]])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = "cuda"
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def flush() -> None:
        scratch.fill_(1)

    def spin(c: int) -> Callable[[], None]:
        return lambda: torch.cuda._sleep(c)

    f = seq_us([flush])
    spin_us = {c: seq_us([flush, spin(c)]) - f for c in SPINS}
    print(f"# flush {f:.1f} us; spins " + ", ".join(f"{c}: {u:.1f} us" for c, u in
                                                  spin_us.items()), flush=True)
    res: dict = {"flush_us": f, "spin_us": spin_us, "gemv": [], "experts": {}, "overlap": {}}
    gen = torch.Generator(device=dev).manual_seed(0)

    # 1. GEMVs
    print("| weight | MB | floor | cold | prefetch (programs/chunk: issue us, then GEMV us) | "
          "GEMV after spin " + " / ".join(f"{spin_us[c]:.1f}" for c in SPINS) + " us |")
    print("|---|---|---|---|---|---|")
    weights = {}
    for name, N, K in GEMVS:
        w8 = torch.randint(0, 100, (N, K), generator=gen, device=dev,
                           dtype=torch.int8).view(torch.float8_e4m3fn)
        ws = torch.randint(115, 121, (N // 128, K // 128), generator=gen, device=dev,
                           dtype=torch.uint8).view(torch.float8_e8m0fnu)
        x = torch.randn(1, K, generator=gen, device=dev).to(torch.bfloat16)
        weights[name] = (w8, ws, x)
        nbytes = w8.numel() + ws.numel()

        def gemv(w8=w8, ws=ws, x=x) -> None:
            td.fp8_linear(x, w8, ws, 128, torch.bfloat16)

        cold = seq_us([flush, gemv]) - f
        row: dict = {"weight": name, "MB": nbytes / 1e6, "floor_us": nbytes / BW * 1e6,
                     "cold_us": cold, "configs": {}}
        for programs, chunk in CONFIGS:
            def pf(programs=programs, chunk=chunk, w8=w8) -> None:
                tp.l2_bulk_prefetch(w8, programs, chunk)
            issue = seq_us([flush, pf]) - f
            after = seq_us([flush, pf, gemv]) - f - issue
            row["configs"][f"{programs}/{chunk}"] = {"issue_us": issue, "gemv_us": after}
        best = min(row["configs"], key=lambda k: row["configs"][k]["gemv_us"])
        bp, bc = (int(v) for v in best.split("/"))

        def pf_best(w8=w8) -> None:
            tp.l2_bulk_prefetch(w8, bp, bc)
        issue = row["configs"][best]["issue_us"]
        row["best"] = best
        row["after_spin_us"] = {c: seq_us([flush, pf_best, spin(c), gemv]) - f - issue
                                - spin_us[c] for c in SPINS}
        row["serial_spin_us"] = {c: seq_us([flush, spin(c), gemv]) - f - spin_us[c]
                                 for c in SPINS}
        res["gemv"].append(row)
        cfg_s = ", ".join(f"{k}: {v['issue_us']:.1f} / {v['gemv_us']:.1f}"
                          for k, v in row["configs"].items())
        spin_s = " / ".join(f"{row['after_spin_us'][c]:.1f} (no prefetch "
                            f"{row['serial_spin_us'][c]:.1f})" for c in SPINS)
        print(f"| {name} | {nbytes / 1e6:.1f} | {row['floor_us']:.1f} | {cold:.1f} | {cfg_s} | "
              f"{spin_s} |", flush=True)

    # 2. Routed experts at one token
    E, D, inter, k = 256, 4096, 2048, 6
    ex = mxfp4_stacks(E, D, inter, gen, dev, kchunk=True)
    x = torch.randn(1, D, generator=gen, device=dev).to(torch.bfloat16)
    rots = [routing(1, E, k, gen, dev) for _ in range(8)]
    up_stacks = ("w1", "w3", "s1", "s3")
    all_stacks = up_stacks + ("w2", "s2")

    def seq_rot(parts: Callable[[torch.Tensor, torch.Tensor], list[Callable[[], object]]]
                ) -> float:
        """Median µs of one pass, cycling through the routings (one graph holds them all)."""
        calls = []
        for ids, w in rots:
            ps = parts(ids, w)
            calls.append(lambda ps=ps: [p() for p in ps])
        return time_graph(calls)

    def moe(ids: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
        return lambda: tm.moe_experts(x, ids, w, ex, 10.0)

    def mpf(ids: torch.Tensor, which: tuple[str, ...], evict_last: bool = False,
            piece: int = 1 << 20) -> Callable[[], object]:
        return lambda: tp.moe_l2_prefetch(ids, ex, which, evict_last=evict_last, piece=piece)

    cold = seq_rot(lambda i, w: [flush, moe(i, w)]) - f
    exp: dict = {"cold_us": cold, "bytes": 6 * (3 * (inter * D // 2 + inter * D // 32))}
    for label, which, el, piece in (("up", up_stacks, False, 1 << 20),
                                    ("up, 256 KB pieces", up_stacks, False, 1 << 18),
                                    ("up, evict-last", up_stacks, True, 1 << 20),
                                    ("all", all_stacks, False, 1 << 20),
                                    ("all, evict-last", all_stacks, True, 1 << 20)):
        issue = seq_rot(lambda i, w: [flush, mpf(i, which, el, piece)]) - f
        after = seq_rot(lambda i, w: [flush, mpf(i, which, el, piece), moe(i, w)]) - f - issue
        spun = {c: seq_rot(lambda i, w: [flush, mpf(i, which, el, piece), spin(c), moe(i, w)])
                - f - issue - spin_us[c] for c in SPINS[:2]}
        exp[label] = {"issue_us": issue, "experts_us": after, "after_spin_us": spun}
    exp["serial_spin_us"] = {c: seq_rot(lambda i, w: [flush, spin(c), moe(i, w)]) - f
                             - spin_us[c] for c in SPINS[:2]}
    res["experts"] = exp
    print(f"\n# routed experts, one token: cold {cold:.1f} us "
          f"({exp['bytes'] / 1e6:.1f} MB, floor {exp['bytes'] / BW * 1e6:.1f} us); "
          f"after a spin without prefetch " + " / ".join(
              f"{exp['serial_spin_us'][c]:.1f}" for c in SPINS[:2]))
    print("| prefetch | issue us | experts right after | after spin " +
          " / ".join(f"{spin_us[c]:.1f}" for c in SPINS[:2]) + " us |")
    print("|---|---|---|---|")
    for label, v in exp.items():
        if isinstance(v, dict) and "issue_us" in v:
            print(f"| {label} | {v['issue_us']:.1f} | {v['experts_us']:.1f} | " +
                  " / ".join(f"{v['after_spin_us'][c]:.1f}" for c in SPINS[:2]) + " |",
                  flush=True)

    # 3. The next GEMV's weight prefetched under the experts
    w8, ws, xq = weights["wq_b"]

    def gemv_q() -> None:
        td.fp8_linear(xq, w8, ws, 128, torch.bfloat16)
    best = next(r for r in res["gemv"] if r["weight"] == "wq_b")["best"]
    bp, bc = (int(v) for v in best.split("/"))

    def pf_q() -> None:
        tp.l2_bulk_prefetch(w8, bp, bc)
    base = seq_rot(lambda i, w: [flush, moe(i, w), gemv_q]) - f
    with_pf = seq_rot(lambda i, w: [flush, pf_q, moe(i, w), gemv_q]) - f
    both = seq_rot(lambda i, w: [flush, mpf(i, up_stacks), pf_q, moe(i, w), gemv_q]) - f
    res["overlap"] = {"experts_then_wq_b_us": base, "with_wq_b_prefetch_us": with_pf,
                      "with_up_and_wq_b_prefetch_us": both}
    print(f"\n# experts then wq_b: {base:.1f} us; wq_b prefetched before the experts "
          f"{with_pf:.1f} us; also the up stacks {both:.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
