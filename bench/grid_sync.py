"""What a dependent step costs: a kernel boundary (plain or PDL) against a grid-wide barrier
inside one persistent kernel (dsv4 issue #5: a B=1 decode layer is ~28 dependent kernels, and
the case for a persistent per-layer kernel rests on the difference).

    PYTHONPATH=. python bench/grid_sync.py [--phases 32] [--kb 0,256,2048]

Each phase streams about ``kb`` KiB (rounded up to 4 KiB a program) of fresh weight-like data
split over one program per SM (a replay runs up to 8 sets of phases, together past L2), and the next phase depends on every program of the previous one.  Three forms, each
captured in a CUDA graph and replayed:

* ``kernels``: one launch per phase, plain stream order;
* ``kernels+pdl``: the same launches with programmatic dependent launch (each waits in its
  first instruction, as dsv4's kernels do);
* ``persistent``: one launch of SM-count programs looping over the phases, a grid barrier
  (release-add on a counter, acquire-spin until every program of the phase has arrived)
  between phases.

It prints µs per phase and, against the bytes' time at 4.29 TB/s, the fixed cost a phase
boundary adds.  The persistent form needs every program resident at once (one 4-warp program
per SM); ``--programs`` lowers the count.

Measured (H100, docs/PERFORMANCE.md thirty-second session): with nothing to stream a phase
costs 1.35 µs as plain kernels, 0.88 with PDL and 1.22 through the grid barrier — a barrier
is no cheaper than a PDL boundary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.flash_bench import graph_time  # noqa: E402
from dsv4.ops.pdl import grid_dependency_sync  # noqa: E402

BW = 4.29e12
BLOCK = 1024          # int32 words a program loads per step (4 KiB)


@triton.jit
def _stream(src_ptr, dst_ptr, phase, words_per_prog, pid, BLOCK: tl.constexpr):
    """Sum a program's share of phase ``phase``'s words (int32; a multiple of BLOCK, 16-byte
    loads) and store it (so the loads are kept)."""
    base = src_ptr + phase.to(tl.int64) * words_per_prog * tl.num_programs(0) \
        + pid.to(tl.int64) * words_per_prog
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(0, words_per_prog, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK))
    tl.store(dst_ptr + pid, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["phase"])
def _phase_kernel(src_ptr, dst_ptr, phase, words_per_prog, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    _stream(src_ptr, dst_ptr, phase, words_per_prog, tl.program_id(0), BLOCK)


@triton.jit(do_not_specialize=["phases"])
def _persistent_kernel(src_ptr, dst_ptr, count_ptr, phases, words_per_prog,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    for phase in range(0, phases):
        _stream(src_ptr, dst_ptr, phase, words_per_prog, pid, BLOCK)
        # Every thread's stores before the arrival; then wait for the whole grid.
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        target = (phase + 1) * progs
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=32)
    ap.add_argument("--kb", default="0,256,2048", help="KiB streamed per phase")
    ap.add_argument("--programs", type=int, default=0, help="0: one per SM")
    args = ap.parse_args()
    dev = torch.device("cuda")
    progs = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    dst = torch.zeros(progs, dtype=torch.int32, device=dev)
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    print(f"{progs} programs, {args.phases} phases, {torch.cuda.get_device_name(dev)}")
    print("| KiB a phase | bytes' time | kernels | kernels+pdl | persistent | "
          "fixed cost a phase: kernels / pdl / persistent |")
    print("|---|---|---|---|---|---|")
    for kb in (int(v) for v in args.kb.split(",")):
        # int32 words a program streams a phase, whole 4 KiB steps (0: none)
        words = -(-kb * 256 // (progs * BLOCK)) * BLOCK
        # Enough phases' data to pass L2 (60 MiB) before a phase's data comes round again.
        sets = max(1, -(-(120 << 20) // max(1, words * 4 * progs * args.phases)))
        srcs = [torch.randint(0, 7, (max(1, args.phases * progs * words),), dtype=torch.int32,
                              device=dev) for _ in range(min(sets, 8))]
        rounds = len(srcs)   # a replay runs every set once, so each replay's bytes pass L2

        def kernels(pdl: bool) -> None:
            extra = {"PDL": True, "launch_pdl": True} if pdl else {}
            for s in srcs:
                for p in range(args.phases):
                    _phase_kernel[(progs,)](s, dst, p, words, BLOCK=BLOCK, num_warps=4, **extra)

        def persistent() -> None:
            for s in srcs:
                count.zero_()   # a memset node a round: ~1/phases of its cost lands on a phase
                _persistent_kernel[(progs,)](s, dst, count, args.phases, words, BLOCK=BLOCK,
                                             num_warps=4)

        n = args.phases * rounds
        t_k = graph_time(lambda: kernels(False)) * 1e6 / n
        t_p = graph_time(lambda: kernels(True)) * 1e6 / n
        t_s = graph_time(persistent) * 1e6 / n
        kib = words * 4 * progs / 1024
        floor = kib * 1024 / BW * 1e6
        print(f"| {kib:.0f} | {floor:.2f} | {t_k:.2f} | {t_p:.2f} | {t_s:.2f} | "
              f"{t_k - floor:.2f} / {t_p - floor:.2f} / {t_s - floor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
