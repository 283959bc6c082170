"""Kernel timeline of a captured CUDA graph: which kernels one replay runs, in order, with their
device durations and the idle gaps between them (torch.profiler / CUPTI sees the kernels of a
graph replay one by one).

    from bench.timeline import graph_timeline
    text = graph_timeline(graph, replays=3)     # a printable report

Used by ``bench/flash_bench.py --timeline FILE``.  The report has (1) the step's span, the sum
of kernel durations and the sum of gaps, per replay; (2) kernels by name: count, total µs and
mean µs per replay; (3) the ordered list of one replay (name, start offset, duration, gap).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

import torch


def _kernels(trace_path: str) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every GPU kernel in a chrome trace, by start."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    out = [(float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "?")))
           for e in events if e.get("cat") == "kernel" and "ts" in e]
    return sorted(out)


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def graph_timeline(graph: torch.cuda.CUDAGraph, replays: int = 3) -> str:
    """Profile ``replays`` replays of ``graph`` (one synchronize between them) and report."""
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        ks = _kernels(path)
    finally:
        os.unlink(path)
    if not ks:
        return "no kernels in the trace (CUPTI unavailable?)\n"
    # Split into replays at the largest gaps (the host synchronizes between replays).
    gaps = [(ks[i][0] - (ks[i - 1][0] + ks[i - 1][1]), i) for i in range(1, len(ks))]
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: replays - 1])
    bounds = [0] + cuts + [len(ks)]
    runs = [ks[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    lines = [f"{len(ks)} kernels over {len(runs)} replays"]
    for r, run in enumerate(runs):
        span = run[-1][0] + run[-1][1] - run[0][0]
        busy = sum(d for _, d, _ in run)
        lines.append(f"replay {r}: {len(run)} kernels, span {span:.1f} us, kernel time "
                     f"{busy:.1f} us, gaps {span - busy:.1f} us "
                     f"({(span - busy) / max(1, len(run) - 1):.2f} us per boundary)")
    by_name: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        for _, d, n in run:
            by_name[n].append(d)
    lines.append("\nby kernel (per replay): count, total us, mean us")
    for n, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{len(ds) / len(runs):6.1f} {sum(ds) / len(runs):9.1f} "
                     f"{sum(ds) / len(ds):8.2f}  {_short(n)}")
    last = runs[-1]
    lines.append("\nreplay order (last replay): start us, dur us, gap us, name")
    prev_end = last[0][0]
    for t, d, n in last:
        lines.append(f"{t - last[0][0]:9.1f} {d:7.2f} {t - prev_end:6.2f}  {_short(n)}")
        prev_end = t + d
    return "\n".join(lines) + "\n"
