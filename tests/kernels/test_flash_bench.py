"""Smoke run of bench/flash_bench.py on CPU at toy widths: the benchmark's model building (random
weights in checkpoint formats, quantized storage), prefill, batched decode on copied contexts and
the floor arithmetic all run and produce finite, positive numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "flash_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("flash_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flash_bench_tiny_cpu(tmp_path) -> None:
    fb = _load()
    out = tmp_path / "r.json"
    rc = fb.main(["--tiny", "--device", "cpu", "--layers", "4", "--prefill", "300",
                  "--decode-batches", "1,3", "--ctx", "260", "--steps", "1", "--reps", "1",
                  "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert not r["errors"], r["errors"]
    assert [p["S"] for p in r["prefill"]] == [300] and r["prefill"][0]["finite"]
    assert [d["B"] for d in r["decode"]] == [1, 3]
    for d in r["decode"]:
        assert d["eager_step_s"] > 0 and d["floor_s"] > 0 and d["kv_bytes"] > 0
    # More requests touch more distinct experts: the weight floor grows with the batch.
    e1, e3 = (d["weight_bytes"]["experts"] for d in r["decode"])
    assert e3 > e1 > 0
    assert len(r["moe_only"]) == 2


def test_flash_bench_expert_count(tmp_path) -> None:
    """--experts N: N routed experts a layer (hash tables included), the batch-1 expert bytes
    those of top-k experts whatever N, and out-of-range counts refused."""
    fb = _load()
    out = tmp_path / "r.json"
    rc = fb.main(["--tiny", "--device", "cpu", "--layers", "4", "--experts", "8", "--prefill",
                  "", "--decode-batches", "1", "--ctx", "40", "--steps", "1", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert not r["errors"], r["errors"]
    assert r["experts"] == 8
    cfg = fb.flash_config(4, tiny=True, experts=8)
    assert cfg.n_routed_experts == 8
    full = fb.flash_config(3, tiny=True)
    # B=1: exactly top-k experts a layer, with 8 experts as with 16.
    distinct = r["decode"][0]["weight_bytes"]["distinct_experts_per_layer"]
    assert distinct == pytest.approx(full.n_activated_experts)
    for bad in (full.n_activated_experts - 1, 257):
        with pytest.raises(ValueError, match="--experts"):
            fb.flash_config(3, experts=bad)


def test_flash_floors_at_real_widths() -> None:
    """The floor arithmetic at V4-Flash widths, without building a model: config and KV bytes."""
    fb = _load()
    cfg = fb.flash_config(4)
    assert (cfg.dim, cfg.n_heads, cfg.head_dim, cfg.n_routed_experts) == (4096, 64, 512, 256)
    assert [cfg.ratio(i) for i in range(4)] == [0, 0, 4, 128]
    # 4 layers at 8K: 4 windows of 128 rows, CSA 512 picks + 2048 index keys, HCA 64 entries.
    want = 4 * 128 * 512 * 2 + 512 * 512 * 2 + 2048 * 128 * 2 + 64 * 512 * 2
    assert fb.kv_bytes(cfg, 8192, 1) == want
    assert fb.kv_bytes(cfg, 8192, 16) == 16 * want
    # The official records: 584 B per attention row, 68 B per index key.
    want8 = (4 * 128 + 512 + 64) * 584 + 2048 * 68
    assert fb.kv_bytes(cfg, 8192, 1, records=True) == want8
