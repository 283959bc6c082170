"""Kernel timeline of a captured CUDA graph: which kernels one replay runs, in order, with their
device durations and the idle gaps between them (torch.profiler / CUPTI sees the kernels of a
graph replay one by one).

    from bench.timeline import graph_timeline
    text = graph_timeline(graph, replays=3)     # a printable report

Used by ``bench/flash_bench.py --timeline FILE``.  The report has (1) the step's span, the sum
of kernel durations and the sum of gaps, per replay; (2) kernels by name: count, total µs and
mean µs per replay; (3) the ordered list of one replay (name, start offset, duration, gap).

``eager_gaps(fn)`` (``bench/flash_bench.py --gaps FILE``, for prefill steps): where the GPU
sits idle during one eager call, charged to the Python site that launched the work after each
gap, with the host calls that blocked meanwhile.
"""

from __future__ import annotations

import json
import os
import re
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


# ------------------------------------------------------------------ eager steps: idle gaps
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_OURS = re.compile(r"dsv4/(model|ops|cache|engine|dist)/")


def _site(stack: list[str]) -> str:
    """The two innermost dsv4 frames of a Python stack (outermost first; file names without
    their folders), else the innermost frame."""
    ours = [f.rsplit("/", 1)[-1] for f in stack if _OURS.search(f)]
    return " > ".join(ours[-2:]) if ours else (stack or ["?"])[-1]


def gap_report(events: list[dict], min_gap_us: float = 5.0, top: int = 25) -> str:
    """Where the GPU sits idle in one eager call: from a chrome trace's events (torch.profiler
    with CPU + CUDA activities and ``with_stack=True``), the idle intervals of the union of all
    streams' GPU work, each charged to the Python site (innermost dsv4 frame) that launched the
    GPU work ending it, and the host calls that blocked during it (synchronizing copies)."""
    gpu = sorted(((float(e["ts"]), float(e.get("dur", 0.0)), e) for e in events
                  if e.get("cat") in _GPU_CATS and "ts" in e), key=lambda v: v[:2])
    if not gpu:
        return "no GPU events in the trace (CUPTI unavailable?)\n"
    # Runtime calls (torch's kernels, copies) and driver calls (Triton's cuLaunchKernelEx).
    host_api = ("cuda_runtime", "cuda_driver")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in host_api and "correlation" in e.get("args", {})}
    py = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("tid"),
           str(e.get("name"))) for e in events if e.get("cat") == "python_function"]
    py.sort(key=lambda v: (v[0], -v[1]))    # outermost frame first at equal starts

    def stack_at(ts: float, tid: object) -> list[str]:
        return [n for a, b, t, n in py if t == tid and a <= ts <= b]

    gaps = []
    end, busy = gpu[0][0], 0.0
    for ts, dur, e in gpu:
        if ts > end:
            gaps.append((ts - end, end, e))
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    span = end - gpu[0][0]
    blocking = [e for e in events if e.get("cat") in host_api
                and any(k in str(e.get("name")) for k in ("Synchronize", "Memcpy"))]
    by_site: dict[str, list[float]] = defaultdict(list)
    rows = []
    for g, start, e in gaps:
        if g < min_gap_us:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        site = _site(stack_at(float(launch["ts"]), launch.get("tid"))) if launch else "?"
        syncs = [b for b in blocking if float(b["ts"]) < start + g
                 and float(b["ts"]) + float(b.get("dur", 0.0)) > start
                 and float(b.get("dur", 0.0)) > 0.5 * min_gap_us]
        blocked = _site(stack_at(float(syncs[0]["ts"]), syncs[0].get("tid"))) if syncs else ""
        by_site[site].append(g)
        rows.append((g, start - gpu[0][0], _short(str(e.get("name")), 40), site, blocked))
    idle = sum(g for g, _, _ in gaps)
    lines = [f"{len(gpu)} GPU events, span {span:.1f} us, busy {busy:.1f} us, idle {idle:.1f} us "
             f"({len(rows)} gaps >= {min_gap_us:g} us hold {sum(r[0] for r in rows):.1f} us)",
             "\nidle by the site launching the work after the gap: count, total us, site"]
    for s, gs in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{len(gs):5d} {sum(gs):9.1f}  {s}")
    lines.append("\nlargest gaps: us, at us, next GPU work, its site | a blocking host call's site")
    for g, at, name, site, blocked in sorted(rows, key=lambda r: -r[0])[:top]:
        lines.append(f"{g:8.1f} {at:9.1f}  {name}  {site}" + (f" | {blocked}" if blocked else ""))
    return "\n".join(lines) + "\n"


def eager_gaps(fn, min_gap_us: float = 5.0, top: int = 25) -> str:
    """Profile one call of ``fn`` (after a warm-up call) and report its GPU idle gaps
    (:func:`gap_report`)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return gap_report(events, min_gap_us, top)
