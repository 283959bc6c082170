"""Does a decode GEMV get faster when its weight is already in L2, and can a prefetch on a side
stream put it there while latency-bound kernels run?  (Thirteenth session; decides whether
the model should prefetch ``wq_b`` / ``wo_a`` / ``wo_b`` / the shared expert at batch 1.)

    PYTHONPATH=. python bench/l2_prefetch.py [--out l2.json]

One H200, CUDA-graph replays of short sequences; every sequence starts by writing a 256 MB
scratch buffer (evicts L2).  Per FP8 weight shape of a V4-Flash decode step (M = 1, the
model's GEMV plan), µs:

* ``cold``: the GEMV after the flush; ``hot``: after ``l2_prefetch`` of its weight; ``prefetch``:
  the prefetch alone (and its GB/s) at several program counts;
* ``serial``: a ``torch.cuda._sleep`` spin (one thread: a stand-in for the latency-bound kernels
  before the GEMV) then the GEMV; ``overlapped``: the same with the prefetch forked onto a side
  stream at the spin's start.  ``overlapped − spin`` against ``cold`` is what the model would
  gain per GEMV.
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

from dsv4.ops import triton_dense as td  # noqa: E402
from dsv4.ops.triton_prefetch import l2_prefetch  # noqa: E402

SHAPES = [("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("shared_w1+w3", 4096, 4096),
          ("shared_w2", 4096, 2048)]


def seq_us(parts: list[Callable[[], object]]) -> float:
    """Median µs of one pass over ``parts`` (``bench/kernels.py`` ``time_graph``: CUDA-graph
    replays)."""
    return time_graph([lambda: [f() for f in parts]])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spin-cycles", type=int, default=30000, help="torch.cuda._sleep cycles")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = "cuda"
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()

    def flush() -> None:
        scratch.fill_(1)

    def spin() -> None:
        torch.cuda._sleep(args.spin_cycles)

    def forked(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            spin()
            torch.cuda.current_stream().wait_stream(side)
        return run

    base = {"flush": seq_us([flush]), "spin": seq_us([flush, spin]) - seq_us([flush])}
    print(f"# flush {base['flush']:.1f} us; spin {base['spin']:.1f} us "
          f"({args.spin_cycles} cycles)")
    print("| weight | MB | cold | hot | prefetch (programs: us, GB/s) | serial − spin | "
          "overlapped − spin | gain |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, N, K in SHAPES:
        w8 = torch.randint(0, 100, (N, K), generator=gen, device=dev,
                           dtype=torch.int8).view(torch.float8_e4m3fn)
        ws = torch.randint(115, 121, (N // 128, K // 128), generator=gen, device=dev,
                           dtype=torch.uint8).view(torch.float8_e8m0fnu)
        x = torch.randn(1, K, generator=gen, device=dev).to(torch.bfloat16)
        nbytes = w8.numel() + ws.numel()

        def gemv() -> None:
            td.fp8_linear(x, w8, ws, 128, torch.bfloat16)

        f = base["flush"]
        cold = seq_us([flush, gemv]) - f
        pre = {}
        for p in (16, 32, 66, 132, 264):
            pre[p] = seq_us([flush, lambda p=p: l2_prefetch(w8, p)]) - f
        best_p = min(pre, key=pre.get)
        pf = lambda: l2_prefetch(w8, best_p)  # noqa: E731
        hot = seq_us([flush, pf, gemv]) - f - pre[best_p]
        hot_el = seq_us([flush, lambda: l2_prefetch(w8, best_p, evict_last=True), gemv]) \
            - f - pre[best_p]
        serial = seq_us([flush, spin, gemv]) - f - base["spin"]
        over = seq_us([flush, forked(pf), gemv]) - f - base["spin"]
        r = dict(weight=name, N=N, K=K, MB=nbytes / 1e6, cold_us=cold, hot_us=hot,
                 hot_evict_last_us=hot_el, prefetch_us=pre, serial_us=serial,
                 overlapped_us=over, floor_us=nbytes / BW * 1e6)
        rows.append(r)
        pre_s = ", ".join(f"{p}: {u:.1f} ({nbytes / u / 1e3:.0f})" for p, u in pre.items())
        print(f"| {name} | {nbytes / 1e6:.1f} | {cold:.1f} | {hot:.1f} (evict_last "
              f"{hot_el:.1f}) | {pre_s} | {serial:.1f} | {over:.1f} | {serial - over:.1f} |",
              flush=True)
    res = {"base": base, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
