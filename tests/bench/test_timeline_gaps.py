"""bench/timeline.py ``gap_report``: idle intervals of a chrome trace's GPU work (all streams
united), each charged to the dsv4 Python frames that launched the work ending it (runtime and
driver launches alike), with the blocking host call that overlapped it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TIMELINE = Path(__file__).resolve().parents[2] / "bench" / "timeline.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_timeline", TIMELINE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_timeline"] = mod
    spec.loader.exec_module(mod)
    return mod


def _trace() -> list[dict]:
    k = lambda ts, dur, name, c: {"cat": "kernel", "ts": ts, "dur": dur, "name": name,  # noqa
                                  "args": {"correlation": c}}
    return [
        k(0, 10, "k0", 1), k(30, 10, "k1", 2), k(35, 20, "k2", 3),      # k2 overlaps k1
        {"cat": "gpu_memcpy", "ts": 100, "dur": 5, "name": "Memcpy HtoD",
         "args": {"correlation": 4}},
        {"cat": "cuda_driver", "ts": 25, "dur": 3, "name": "cuLaunchKernelEx", "tid": 1,
         "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "ts": 90, "dur": 20, "name": "cudaMemcpyAsync", "tid": 1,
         "args": {"correlation": 4}},
        {"cat": "python_function", "ts": 20, "dur": 10, "tid": 1,
         "name": "/r/dsv4/model/attention.py(10): forward"},
        {"cat": "python_function", "ts": 24, "dur": 5, "tid": 1,
         "name": "/r/dsv4/ops/triton_attn.py(99): sparse_attn"},
        {"cat": "python_function", "ts": 85, "dur": 30, "tid": 1,
         "name": "/r/dsv4/model/context.py(5): build"},
    ]


def test_gap_report_charges_idle_time_to_launch_sites() -> None:
    text = _load().gap_report(_trace(), min_gap_us=5)
    first = text.splitlines()[0]
    # busy = k0 10 + union(k1, k2) 25 + copy 5; idle = 20 + 45 over a 105 µs span
    assert first.startswith("4 GPU events, span 105.0 us, busy 40.0 us, idle 65.0 us"), first
    assert "45.0  context.py(5): build" in text
    assert "20.0  attention.py(10): forward > triton_attn.py(99): sparse_attn" in text
    # the 45 µs gap overlaps the 20 µs cudaMemcpyAsync issued from build
    assert "Memcpy HtoD  context.py(5): build | context.py(5): build" in text
    assert "no GPU events" in _load().gap_report([{"cat": "cpu_op", "ts": 0}])
