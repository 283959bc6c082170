"""Server metrics in the Prometheus text exposition format (version 0.0.4), hand-written.

Counters: requests by outcome, prompt and generated tokens.  Gauges (from the engine's last
``get_stats()``): running / waiting requests and cache usage.  Histograms: time to first token
and time per output token (one observation per finished request: its mean inter-token time).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence

PREFIX = "dsv4"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)
REQUEST_OUTCOMES = ("ok", "bad_request", "unauthorized", "aborted", "error")


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus expects."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, c in zip(self.bounds + (math.inf,), self.counts):
            running += c
            out.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {running}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class ServerMetrics:
    """Thread-safe store of the server's metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = {k: 0 for k in REQUEST_OUTCOMES}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def count_request(self, outcome: str) -> None:
        if outcome not in self.requests:
            raise ValueError(f"outcome: expected one of {REQUEST_OUTCOMES}; found {outcome!r}")
        with self._lock:
            self.requests[outcome] += 1

    def add_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        with self._lock:
            self.tpot.observe(seconds)

    def render(self, engine_stats: Mapping[str, object] | None = None) -> str:
        """The exposition text; gauges come from ``engine_stats`` (``get_stats()``)."""
        stats = dict(engine_stats or {})
        p = PREFIX
        lines: list[str] = []

        def head(name: str, kind: str, doc: str) -> None:
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")

        with self._lock:
            head(f"{p}_requests_total", "counter", "Finished HTTP generation requests by outcome.")
            for outcome, n in self.requests.items():
                lines.append(f'{p}_requests_total{{status="{outcome}"}} {n}')
            head(f"{p}_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.")
            lines.append(f"{p}_prompt_tokens_total {self.prompt_tokens}")
            head(f"{p}_generation_tokens_total", "counter", "Generated tokens.")
            lines.append(f"{p}_generation_tokens_total {self.generation_tokens}")
            head(f"{p}_time_to_first_token_seconds", "histogram",
                 "Time from request arrival to its first generated token.")
            lines += self.ttft.lines(f"{p}_time_to_first_token_seconds")
            head(f"{p}_time_per_output_token_seconds", "histogram",
                 "Mean time between output tokens, one observation per request.")
            lines += self.tpot.lines(f"{p}_time_per_output_token_seconds")
        gauges = (("num_requests_running", "num_running", "Requests being generated."),
                  ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
                  ("cache_usage", "cache_usage", "Fraction of cache pages in use (0-1)."))
        for name, key, doc in gauges:
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                head(f"{p}_{name}", "gauge", doc)
                lines.append(f"{p}_{name} {_fmt(value)}")
        # Any other numeric engine statistic ("*_total" ones are counters).
        for key in sorted(stats):
            value = stats[key]
            if key in ("num_running", "num_waiting", "cache_usage"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = f"{p}_engine_" + "".join(c if c.isalnum() else "_" for c in key)
                kind = "counter" if name.endswith("_total") else "gauge"
                head(name, kind, f"Engine statistic {key}.")
                lines.append(f"{name} {_fmt(value)}")
        return "\n".join(lines) + "\n"
