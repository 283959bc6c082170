"""bench/memory_plan.py: weight totals against the spec, shards summing back to the model, the
cache arithmetic against HybridCache and the published record sizes, and the held-dtype rules
against a model actually built and loaded with quantized storage."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.checkpoint import load_checkpoint
from dsv4.config import ModelConfig
from dsv4.formats import QuantWeight

BENCH = Path(__file__).resolve().parents[2] / "bench" / "memory_plan.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("dsv4_memory_plan", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


mp = _load_bench()
GIB = mp.GIB
SPLIT_KINDS = ("routed_experts", "attn_split", "shared_expert", "engram_table")


@pytest.fixture(scope="module")
def cfgs() -> dict[str, ModelConfig]:
    return {name: mp.load_named_config(name) for name in ("flash", "pro", "v41")}


@pytest.fixture(scope="module")
def flash_tp2_ep(cfgs):
    return mp.weight_plan(cfgs["flash"], 2, True)


@pytest.fixture(scope="module")
def v41_tp8_ep(cfgs):
    return mp.weight_plan(cfgs["v41"], 8, True)


def test_checkpoint_totals_match_the_published_sizes(cfgs, flash_tp2_ep, v41_tp8_ep) -> None:
    # Spec / issue 8: V4-Flash ~149 GiB, V4.1-Flash ~474 GiB (spec §1.6: ~475 GiB), Pro ~865 GB.
    assert flash_tp2_ep.checkpoint_bytes / GIB == pytest.approx(149, rel=0.03)
    assert v41_tp8_ep.checkpoint_bytes / GIB == pytest.approx(474, rel=0.03)
    pro = mp.weight_plan(cfgs["pro"], 1, False)
    assert pro.checkpoint_bytes / 1e9 == pytest.approx(865, rel=0.03)
    # V4.1 Engram tables: 2 x ~384M rows x (256 e4m3 + 8 e8m0) bytes (SERVING.md: ~189 GiB)
    assert v41_tp8_ep.checkpoint["engram_table"] / GIB == pytest.approx(189, rel=0.01)
    # one process holds everything
    assert pro.rank_held(0) == sum(pro.held_total.values())


@pytest.mark.parametrize("which", ["flash_tp2_ep", "v41_tp8_ep", "flash_tp2"])
def test_shards_sum_back_to_the_model(request, cfgs, which: str) -> None:
    wp = (mp.weight_plan(cfgs["flash"], 2, False) if which == "flash_tp2"
          else request.getfixturevalue(which))
    n = wp.world_size
    for kind in mp.KIND_TITLES:
        stored = sum(wp.per_rank_stored[r][kind] for r in range(n))
        held = sum(wp.per_rank_held[r][kind] for r in range(n))
        copies = 1 if kind in SPLIT_KINDS else n  # split kinds once, the others on every rank
        assert stored == copies * wp.checkpoint[kind], kind
        assert held == copies * wp.held_total[kind], kind
    # experts and Engram rows really are split: each rank holds ~1/n of them
    for r in range(n):
        assert wp.per_rank_stored[r]["routed_experts"] * n == pytest.approx(
            wp.checkpoint["routed_experts"], rel=1e-6)
        if wp.checkpoint["engram_table"]:
            assert wp.per_rank_stored[r]["engram_table"] * n == pytest.approx(
                wp.checkpoint["engram_table"], rel=1e-6)


def test_bf16_cache_equals_hybrid_cache(cfgs) -> None:
    for name, cfg in cfgs.items():
        cp = mp.cache_plan(cfg, "bf16")
        assert cp.bytes_per_page == HybridCache.bytes_per_page(cfg, 256, torch.bfloat16), name
        assert cp.bytes_per_slot == HybridCache.bytes_per_slot(cfg, torch.bfloat16), name


def test_official_record_sizes(cfgs) -> None:
    flash = mp.cache_plan(cfgs["flash"], "fp8", "fp8")
    # SERVING.md §1.1: 584 B records, 146 B/token per C4A layer, 132 B FP8 indexer keys
    assert flash.fmt.window == flash.fmt.compressed == 584 and flash.fmt.index_key == 132
    # what HybridCache stores by default: fp4 index keys (68 B)
    assert mp.cache_plan(cfgs["flash"], "fp8").fmt.index_key == 68
    assert flash.page_parts["compressed KV r=4"] / 256 == pytest.approx(21 * 146, abs=21)
    assert flash.page_parts["index keys r=4"] / 256 == pytest.approx(21 * 33, abs=21)
    assert flash.slot_parts["window ring"] == 43 * 128 * 584
    assert mp.cache_format(cfgs["flash"], "fp8", "fp4").index_key == 68
    v41 = mp.cache_plan(cfgs["v41"], "fp8")
    assert v41.fmt.compressed == 288 and v41.fmt.index_key == 68
    # the V4.1 recipe: "Global KV 890 bytes/token"
    assert v41.bytes_per_token == pytest.approx(890)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        mp.cache_format(cfgs["v41"], "int4")


def test_max_concurrency_is_the_fitting_edge(cfgs, flash_tp2_ep) -> None:
    cp = mp.cache_plan(cfgs["flash"], "fp8")
    allow = mp.Allowances()
    budget = int(mp.H200_TOTAL_BYTES * 0.9)
    c = mp.max_concurrency(flash_tp2_ep, cp, allow, 8192, budget)
    assert c > 64
    assert mp.plan_total(flash_tp2_ep, cp, allow, 8192, c)["total"] <= budget
    assert mp.plan_total(flash_tp2_ep, cp, allow, 8192, c + 1)["total"] > budget
    lines = mp.plan_total(flash_tp2_ep, cp, allow, 8192, 16)
    assert lines["cache pages"] == 16 * 32 * cp.bytes_per_page
    assert lines["total"] == sum(v for k, v in lines.items() if k != "total")


def _model_bytes(model: torch.nn.Module) -> int:
    from dsv4.model.layers import Linear

    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, Linear) and m.holds_quantized:
            total += m.qweight.weight.nbytes + m.qweight.scale.nbytes
    return total


def _value_bytes(v: object) -> int:
    if isinstance(v, QuantWeight):
        return v.weight.nbytes + v.scale.nbytes
    assert isinstance(v, torch.Tensor)
    return v.nbytes


@pytest.mark.parametrize("variant", ["v4", "v4-base", "v41"])
def test_held_rules_match_a_loaded_model(tmp_path, variant: str) -> None:
    from dsv4.dist.parallel import Parallel
    from dsv4.dist.sharding import shard_plan
    from dsv4.model.layers import Linear, quantized_storage
    from dsv4.model.transformer import Transformer
    from dsv4.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    path = str(make_tiny_checkpoint(tmp_path / variant, variant=variant, seed=0))
    cfg = ModelConfig.from_file(path)
    worlds = [1]
    if "parallel" in inspect.signature(Transformer).parameters:
        worlds.append(2)
    for world in worlds:
        wp = mp.weight_plan(cfg, world, True)
        for rank in range(world):
            kw = {}
            plan = {}
            if world > 1:
                par = Parallel(rank=rank, world_size=world, expert_parallel=True)
                kw, plan = {"parallel": par}, shard_plan(cfg, par)
            with quantized_storage(True):
                model = Transformer(cfg, dtype=torch.bfloat16, **kw)
            tensors = load_checkpoint(path, cfg, dtype=torch.bfloat16, keep_quantized=True,
                                      progress=False, shard_plan=plan)
            loaded = sum(_value_bytes(v) for v in tensors.values())
            model.load_tensors(tensors, consume=False)
            # FP8 Linear weights are adopted as loaded; everything else is copied.
            adopted = sum(_value_bytes(m.qweight) for m in model.modules()
                          if isinstance(m, Linear) and m.holds_quantized
                          and any(m.qweight is v for v in tensors.values()))
            assert _model_bytes(model) == wp.rank_held(rank), (world, rank)
            assert loaded - adopted == wp.load_copied[rank], (world, rank)


def test_cli_prints_the_plan_and_rejects_bad_input(capsys) -> None:
    assert mp.main(["--model", "flash", "--gpus", "2", "--ep", "--concurrency", "1,64"]) == 0
    out = capsys.readouterr().out
    assert "EP: 128 experts / rank" in out and "| headroom |" in out
    assert "Largest concurrency at 8192 tokens" in out
    # V4-Pro's 128 heads do not split over 3 GPUs
    assert mp.main(["--model", "pro", "--gpus", "3", "--ep"]) == 2
    assert "num_attention_heads=128" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mp.main(["--model", "flash", "--gpus", "2", "--tp", "1"])
    with pytest.raises(ValueError, match="not known"):
        mp.load_named_config("v5")
