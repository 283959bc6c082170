"""Time the indexer's top-k kernel (``dsv4/ops/triton_topk.py``) against its torch twin (two
stable sorts) on one GPU.

    PYTHONPATH=. python bench/topk_bench.py [--plans] [--out results.json]

Per shape (T rows, L entries, k picks; the GPU tests' shapes, plus long-L engines whose rows
see only part of L, as in static-shape decode steps): the device time of the twin and of the
kernel (median of CUDA-graph replays over enough input copies to overflow L2;
``bench/kernels.py``'s timer), the speed-up, and whether the outputs were identical.  Rows score
``randn``, −inf past their ``n_visible``.  ``--plans`` also times the kernel's long-row plans
(stream / split) and warp counts one by one.

Without CUDA it runs one tiny shape through the Triton interpreter (set ``TRITON_INTERPRET=1``
before starting it) as a smoke test: those times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from dsv4.ops import torch_attn
from dsv4.ops import triton_topk as tk

# (T, L, k, visible entries per row: None = L, all of it).
GPU_SHAPES = [(1, 2048, 512, None), (64, 2048, 512, None), (16, 16384, 512, None),
              (2048, 2048, 512, None), (4, 65536, 1024, None)]
EXTRA_SHAPES = [(64, 65536, 512, 2048), (256, 16384, 512, None), (8192, 2048, 512, None),
                (1, 65536, 1024, None), (1, 16384, 512, None), (132, 2048, 512, None),
                (256, 2048, 512, None), (128, 16384, 512, None)]
SMOKE_SHAPES = [(3, 200, 16, None), (2, 300, 64, 250)]


def make_inputs(T: int, L: int, n_vis: int | None, device: str,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """randn scores [T, L], −inf from each row's n_visible on (L, or ``n_vis`` ± a little)."""
    scores = torch.randn(T, L, device=device, generator=gen)
    if n_vis is None:
        n_visible = torch.full((T,), L, dtype=torch.int64, device=device)
    else:
        jitter = torch.randint(0, max(1, n_vis // 8), (T,), device=device, generator=gen)
        n_visible = (n_vis - jitter).clamp(0, L)
    past = torch.arange(L, device=device)[None, :] >= n_visible[:, None]
    return scores.masked_fill_(past, float("-inf")), n_visible


def _time_cpu(fn: Callable[[], object], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure(T: int, L: int, k: int, n_vis: int | None, device: str, plans: bool) -> dict:
    """Times (µs) of the twin and the kernel at one shape, and whether they agree."""
    gen = torch.Generator(device=device).manual_seed(T * 7 + L + k)
    if device == "cuda":
        from kernels import copies_for, time_graph  # bench/kernels.py
        sets = [make_inputs(T, L, n_vis, device, gen) for _ in range(copies_for(T * L * 4))]

        def timer(fn: Callable[..., object]) -> float:
            return time_graph([lambda s=s: fn(*s, k) for s in sets])
    else:
        sets = [make_inputs(T, L, n_vis, device, gen)]

        def timer(fn: Callable[..., object]) -> float:
            return _time_cpu(lambda: fn(*sets[0], k))
    want = torch_attn.topk_indices(*sets[0], k)
    got = tk.topk_indices(*sets[0], k)
    row = {"T": T, "L": L, "k": k, "n_visible": n_vis or L,
           "exact": bool(torch.equal(got, want)),
           "twin_us": timer(torch_attn.topk_indices), "triton_us": timer(tk.topk_indices)}
    row["speedup"] = row["twin_us"] / row["triton_us"]
    if plans and L > tk.MAX_REG_BLOCK:
        for split, warps, compact in ((False, 4, None), (False, 8, None), (True, 4, None),
                                      (True, 8, True), (True, 8, False)):
            name = (f"{'split' if split else 'stream'}_w{warps}"
                    f"{'' if compact is None else '_c' + str(int(compact))}_us")
            row[name] = timer(lambda s, n, kk, sp=split, w=warps, c=compact:
                              tk.topk_indices_with_block(s, n, kk, None, sp, w, c))
    elif plans:
        for warps in (4, 8):
            for compact in (False, True):
                row[f"w{warps}_c{int(compact)}_us"] = timer(
                    lambda s, n, kk, w=warps, c=compact:
                    tk.topk_indices_with_block(s, n, kk, None, None, w, c))
        # Rows held in registers, cut into 2 or 4 chunks instead (two launches: each chunk
        # keeps its top-k, a merge selects among them).
        top = triton.next_power_of_2(L)
        for blk in (top // 2, top // 4):
            if blk >= max(64, k) and blk < L:
                for warps in (4, 8):
                    row[f"split_b{blk}_w{warps}_us"] = timer(
                        lambda s, n, kk, b=blk, w=warps: tk.topk_indices_with_block(
                            s, n, kk, b, True, w, None))
        radix = tk._RADIX
        try:
            tk._RADIX = 8          # the 256-bin digits, for comparison
            row["w8_c0_r8_us"] = timer(lambda s, n, kk: tk.topk_indices_with_block(
                s, n, kk, None, None, 8, False))
        finally:
            tk._RADIX = radix
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--plans", action="store_true", help="also time each long-row plan / warps")
    ap.add_argument("--no-extra", action="store_true", help="only the GPU tests' shapes")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        device, shapes = "cuda", GPU_SHAPES + ([] if args.no_extra else EXTRA_SHAPES)
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
              f"triton {triton.__version__}")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device, shapes = "cpu", SMOKE_SHAPES
        print("no CUDA: tiny shapes through the Triton interpreter (a smoke test; times mean "
              "nothing)")
    else:
        print("bench/topk_bench.py needs a CUDA GPU, or TRITON_INTERPRET=1 for the smoke test",
              file=sys.stderr)
        return 2
    print(f"{'T':>5} {'L':>6} {'k':>5} {'visible':>7} {'twin us':>9} {'triton us':>10} "
          f"{'speedup':>8}  exact")
    rows = []
    for T, L, k, n_vis in shapes:
        r = measure(T, L, k, n_vis, device, args.plans)
        rows.append(r)
        extra = "  ".join(f"{name}={v:.1f}" for name, v in r.items() if name.endswith("_us")
                          and name not in ("twin_us", "triton_us"))
        print(f"{T:>5} {L:>6} {k:>5} {r['n_visible']:>7} {r['twin_us']:9.1f} "
              f"{r['triton_us']:10.1f} {r['speedup']:8.2f}  {r['exact']}  {extra}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "triton": triton.__version__}
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
