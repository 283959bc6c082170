"""The Prometheus text exposition written by ServerMetrics."""

from __future__ import annotations

import pytest

from dsv4.server.metrics import Histogram, ServerMetrics


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value.replace("+Inf", "inf"))
    return out


def test_histogram_is_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = dict(line.rsplit(" ", 1) for line in h.lines("x"))
    assert lines == {'x_bucket{le="0.1"}': "2", 'x_bucket{le="1"}': "3",
                     'x_bucket{le="+Inf"}': "4", "x_sum": "3.65", "x_count": "4"}


def test_render_counters_gauges_and_engine_stats() -> None:
    m = ServerMetrics()
    m.count_request("ok")
    m.count_request("ok")
    m.count_request("aborted")
    m.add_tokens(prompt=10, generated=7)
    m.observe_ttft(0.03)
    m.observe_tpot(0.002)
    text = m.render({"num_running": 2, "num_waiting": 1, "cache_usage": 0.25,
                     "num_free_pages": 12, "steps_total": 40, "label": "not a number"})
    s = _samples(text)
    assert s['dsv4_requests_total{status="ok"}'] == 2
    assert s['dsv4_requests_total{status="aborted"}'] == 1
    assert s["dsv4_prompt_tokens_total"] == 10 and s["dsv4_generation_tokens_total"] == 7
    assert s["dsv4_num_requests_running"] == 2 and s["dsv4_num_requests_waiting"] == 1
    assert s["dsv4_cache_usage"] == 0.25 and s["dsv4_engine_num_free_pages"] == 12
    assert s['dsv4_time_to_first_token_seconds_bucket{le="0.04"}'] == 1
    assert s['dsv4_time_to_first_token_seconds_bucket{le="0.02"}'] == 0
    assert s["dsv4_time_per_output_token_seconds_count"] == 1
    assert "# TYPE dsv4_engine_steps_total counter" in text
    assert "# TYPE dsv4_num_requests_running gauge" in text
    assert "label" not in text
    # every sample line belongs to a declared metric family
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    for name in s:
        base = name.split("{")[0]
        assert any(base == f or base.startswith(f + "_") for f in families), name
    with pytest.raises(ValueError, match="outcome"):
        m.count_request("weird")
