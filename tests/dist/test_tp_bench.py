"""``bench/tp_bench.py``: the ``--tiny`` run on two CPU processes (gloo) finishes with sane
numbers, with and without expert parallelism and static-shape decode; the floor arithmetic at
V4-Flash's real widths; the budget stops a workload early."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from test_tp_static_decode import ROOT, torchrun

BENCH = Path(ROOT) / "bench" / "tp_bench.py"


def _load():
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("tp_bench", BENCH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH.parent))
    return mod


@pytest.mark.parametrize("extra", [[], ["--ep", "--graphs"],
                                   ["--graphs", "--prefill-graphs", "--experts", "8"]])
def test_tiny_two_processes(tmp_path, extra: list[str]) -> None:
    out = tmp_path / "tp.json"
    t0 = time.monotonic()
    log = torchrun(str(BENCH), ["--tiny", "--out", str(out), *extra], timeout=120)
    assert time.monotonic() - t0 < 90, "the --tiny run should take seconds"
    r = json.loads(out.read_text())
    assert not r["errors"], r["errors"]
    assert r["world_size"] == 2 and r["ep"] == ("--ep" in extra)
    assert len(r["ranks"]) == 2
    for rank in r["ranks"]:
        assert rank["bytes"]["total"] > 0 and rank["num_pages"] > 0
    assert [w["concurrency"] for w in r["workloads"]] == [1, 4]
    for w in r["workloads"]:
        assert not w["partial"]
        assert w["output_tokens"] == w["concurrency"] * r["output_len"]
        assert w["tpot_median_s"] > 0 and w["output_tokens_per_s"] > 0
        assert w["decode_steps"] > 0 and w["decode_step_mean_s"] > 0
        # A CPU is far from the H200 floor: every ratio is > 1.
        assert w["floor_step_s"] > 0 and w["tpot_ratio"] > 1 and w["throughput_ratio"] > 1
        assert len(w["floor_per_rank"]) == 2
    # Rank 0 alone reads the head.
    assert r["workloads"][0]["floor_per_rank"][0]["head"] > 0
    assert r["workloads"][0]["floor_per_rank"][1]["head"] == 0
    if "--graphs" in extra:
        assert r["graph_stats"]["eager_static_steps"] > 0
    else:
        assert r["graph_stats"] is None
    # Prefill graphs only on request under TP (their segments run eagerly on CPUs).
    if "--prefill-graphs" in extra:
        assert r["prefill_graph_stats"]["steps"] > 0
    else:
        assert r["prefill_graph_stats"] is None
    assert "TPOT" in log and "anchor" in log


def test_trace_and_profile(tmp_path) -> None:
    """--trace prints every step; --profile writes the driver's profiler tables of 4 decode-only
    steps per concurrency, with the engine's labelled ranges."""
    prof = tmp_path / "prof.txt"
    log = torchrun(str(BENCH), ["--tiny", "--graphs", "--concurrency", "2", "--output-len", "14",
                                "--trace", "--profile", str(prof)], timeout=120)
    steps = [ln for ln in log.splitlines() if ln.startswith("c=2 step ")]
    assert len(steps) >= 13 and "decode-only True" in steps[-1]
    text = prof.read_text()
    assert "===== concurrency 2, 4 decode-only steps" in text
    for label in ("dsv4.schedule", "dsv4.plan_step", "dsv4.static_step"):
        assert label in text, label


def test_floors_at_real_widths() -> None:
    tb = _load()
    from dsv4.cache.formats import RECORD_DTYPE
    from flash_bench import flash_config  # noqa: E402 (bench/ on the path via tp_bench)

    cfg = flash_config(43)
    one = tb.decode_floor(cfg, 1, False, 1, 8192, RECORD_DTYPE)
    held_one = one["per_rank"][0]["held_weight_bytes"]
    assert 140e9 < held_one < 170e9  # V4-Flash is ~150 GB in its checkpoint formats
    for ep in (False, True):
        f1, f64 = (tb.decode_floor(cfg, 2, ep, b, 8192, RECORD_DTYPE) for b in (1, 64))
        held = [x["held_weight_bytes"] for x in f1["per_rank"]]
        # Each rank holds about half (attention latents, embedding, head are replicated).
        assert all(0.45 * held_one < h < 0.6 * held_one for h in held), held
        assert sum(held) >= held_one
        # B = 1 touches 6 of 256 experts per layer: 3 per rank either way.
        per_rank = f1["per_rank"][1]["experts"]
        full = tb.rank_weight_bytes(cfg, 0, 1, False)
        assert per_rank == pytest.approx(full["expert"] * 6 * 43 / 2, rel=1e-9)
        assert f64["per_rank"][0]["experts"] > 20 * per_rank
        assert f64["floor_step_s"] > f1["floor_step_s"] > 0
        assert f1["floor_step_s"] < one["floor_step_s"]  # two GPUs: a lower floor than one
    assert tb.kv_read_bytes(cfg, 8192, RECORD_DTYPE) < tb.kv_read_bytes(cfg, 8192,
                                                                        torch.bfloat16)


def test_budget_stops_a_workload(monkeypatch) -> None:
    tb = _load()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    args = tb.parse_args(["--tiny", "--layers", "2", "--concurrency", "2"])
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(tb.bench_config_dict(args), f)
        engine = tb.build_engine(args, d)
    r = tb.run_workload(engine, 2, 20, 4, 0, deadline=time.perf_counter() - 1)
    assert r["partial"] and r["output_tokens"] == 0
    engine.check_idle()  # the aborted requests gave their pages back
    r = tb.run_workload(engine, 2, 20, 4, 0, deadline=time.perf_counter() + 60)
    assert not r["partial"] and r["output_tokens"] == 8
    with pytest.raises(SystemExit):
        tb.parse_args(["--tiny", "--output-len", "1"])


def test_host_ms_per_step_and_replay() -> None:
    """The host-phase report: planning per step, broadcast / fill / launch per replayed step,
    from the deltas of the cumulative counters; nothing without replays."""
    mod = _load()
    before = {"plan": 1.0, "broadcast": 0.5, "fill": 0.2, "launch": 0.1, "replays": 10}
    after = {"plan": 1.004, "broadcast": 0.5008, "fill": 0.2012, "launch": 0.1016,
             "replays": 14}
    got = mod._host_ms(before, after, steps=8)
    want = {"plan_per_step": 0.5, "broadcast_per_replay": 0.2, "fill_per_replay": 0.3,
            "launch_per_replay": 0.4}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-9, (k, got[k])
    assert mod._host_ms(before, dict(before), steps=3) is None
