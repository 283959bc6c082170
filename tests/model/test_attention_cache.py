"""HybridCache: shapes of every pool and state, memory sizing, slot reset and step checks."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.tensors import HybridCache, compressor_specs
from dsv4.config import ModelConfig
from test_attention_helpers import tiny_config, tiny_config_dict


def test_pool_and_state_shapes() -> None:
    cfg = tiny_config()
    cache = HybridCache.allocate(cfg, num_pages=5, num_slots=3, page_size=256,
                                 dtype=torch.float32)
    hd, dI, W = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    for layer in range(3):
        assert cache.window_ring(layer).shape == (3, W, hd)
    assert 0 not in cache.compressed
    assert cache.compressed_pool(1).shape == (5, 64, hd)
    assert cache.compressed_pool(2).shape == (5, 2, hd)
    assert cache.index_key_pool(1).shape == (5, 64, dI)
    assert sorted(cache.index_keys) == [1]
    csa = cache.compressor_state(1, "attn")
    assert csa.kv.shape == (3, 8, 2 * hd) and csa.kv.dtype == torch.float32
    assert cache.compressor_state(1, "index").kv.shape == (3, 8, 2 * dI)
    hca = cache.compressor_state(2, "attn")
    # The C128 state: one float64 pseudo-row per slot (the compact form), empty at first.
    assert hca.spec.compact and hca.score.shape == (3, 1, hd)
    assert hca.kv.dtype == hca.score.dtype == torch.float64
    assert torch.isneginf(hca.score).all() and (hca.kv == 0).all()
    with pytest.raises(ValueError, match="no 'index'"):
        cache.compressor_state(2, "index")
    with pytest.raises(ValueError, match="compressed pool"):
        cache.compressed_pool(0)
    with pytest.raises(ValueError, match="index keys"):
        cache.index_key_pool(2)


def test_sizing_matches_allocation() -> None:
    cfg = tiny_config()
    for dtype in (torch.float32, torch.bfloat16):
        a = HybridCache.allocate(cfg, num_pages=4, num_slots=2, page_size=256, dtype=dtype)
        b = HybridCache.allocate(cfg, num_pages=7, num_slots=5, page_size=256, dtype=dtype)
        per_page = HybridCache.bytes_per_page(cfg, 256, dtype)
        per_slot = HybridCache.bytes_per_slot(cfg, dtype)
        assert b.memory_bytes() - a.memory_bytes() == 3 * per_page + 3 * per_slot
        assert a.memory_bytes() == 4 * per_page + 2 * per_slot
    # hand count, bf16: CSA 64 entries × (128 + 128) + HCA 2 entries × 128, 2 bytes each
    assert HybridCache.bytes_per_page(cfg, 256, torch.bfloat16) == (64 * 256 + 2 * 128) * 2


def test_compact_state_rule_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compact: non-overlapping compressors of ratio >= COMPACT_STATE_MIN_RATIO (V4's C128),
    unless DSV4_COMPACT_STATE=0 (the module flag); the sizes follow the allocation."""
    import dsv4.cache.tensors as tensors
    from dsv4.cache.tensors import CompressorSpec

    assert tensors.COMPACT_STATE and tensors.COMPACT_STATE_MIN_RATIO == 8
    hca, csa = CompressorSpec("attn", 128, 512, False), CompressorSpec("attn", 4, 512, True)
    v41, r8 = CompressorSpec("attn", 2, 512, False), CompressorSpec("attn", 8, 64, False)
    assert hca.compact and r8.compact and not csa.compact and not v41.compact
    assert (hca.state_rows, hca.state_dtype, hca.state_bytes) == (1, torch.float64, 8192)
    assert (csa.state_rows, csa.state_dtype, csa.state_bytes) == (8, torch.float32, 65536)
    assert v41.state_bytes == 2 * 2 * 512 * 4
    cfg = tiny_config()
    compact_slot = HybridCache.bytes_per_slot(cfg, torch.float32)
    monkeypatch.setattr(tensors, "COMPACT_STATE", False)
    assert not hca.compact and (hca.state_rows, hca.state_bytes) == (128, 2 * 128 * 512 * 4)
    cache = HybridCache.allocate(cfg, 2, 3, 256, torch.float32)
    raw = cache.compressor_state(2, "attn")
    assert raw.kv.shape == (3, 128, cfg.head_dim) and raw.kv.dtype == torch.float32
    raw_slot = HybridCache.bytes_per_slot(cfg, torch.float32)
    assert cache.memory_bytes() == 2 * HybridCache.bytes_per_page(cfg, 256, torch.float32) \
        + 3 * raw_slot
    # The tiny HCA layer (d 128): 2·128·128·4 raw bytes against 2·1·128·8 compact ones.
    assert raw_slot - compact_slot == 2 * 128 * cfg.head_dim * 4 - 2 * cfg.head_dim * 8


def test_page_size_must_hold_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiple of every compression ratio"):
        HybridCache.allocate(tiny_config(), 2, 1, page_size=64)
    with pytest.raises(ValueError, match="num_slots"):
        HybridCache.allocate(tiny_config(), 2, 0, page_size=128)


def test_reset_slots_clears_only_those_slots() -> None:
    cache = HybridCache.allocate(tiny_config(), 2, 3, 128, torch.float32)
    st = cache.compressor_state(1, "attn")
    hca = cache.compressor_state(2, "attn")            # the compact (float64) form
    for t in (st, hca):
        t.kv.fill_(1.0)
        t.score.fill_(2.0)
    cache.window_ring(0).fill_(3.0)
    cache.reset_slots([0, 2])
    for t in (st, hca):
        assert torch.equal(t.kv[1], torch.ones_like(t.kv[1]))
        assert (t.kv[[0, 2]] == 0).all() and torch.isneginf(t.score[[0, 2]]).all()
    assert (cache.window_ring(0)[[0, 2]] == 0).all() and (cache.window_ring(0)[1] == 3).all()
    with pytest.raises(ValueError, match="slot ids"):
        cache.reset_slots([3])


def test_check_step_reports_missing_pages_and_bad_slots() -> None:
    cache = HybridCache.allocate(tiny_config(), 4, 2, 128, torch.float32)
    cache.check_step([100], [100], [1], [[0, 3]])
    with pytest.raises(ValueError, match="does not cover 201 tokens"):
        cache.check_step([101], [100], [1], [[0, -1]])
    with pytest.raises(ValueError, match="slot 2"):
        cache.check_step([1], [0], [2], [[0]])


def test_v41_sources_are_shared() -> None:
    """V4.1 reuse layers read their KV source's pools; only sources own a compressor."""
    d = tiny_config_dict(model_type="deepseek_v41", num_hidden_layers=6,
                         compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3],
                         index_source_layer_ids=[1, 3, 5], index_head_dim=64)
    cfg = ModelConfig.from_dict(d)
    cache = HybridCache.allocate(cfg, 2, 1, 128, torch.float32)
    assert sorted(cache.compressed) == [1, 3] and sorted(cache.index_keys) == [1, 3]
    assert cache.compressed_pool(2) is cache.compressed[1]
    assert cache.compressed_pool(5) is cache.compressed[3]
    assert cache.index_key_pool(4) is cache.index_keys[3]
    assert [s.ratio for s in compressor_specs(cfg, 1)] == [2]
    assert compressor_specs(cfg, 3) == []          # ratio 1 keeps no carry-over rows
    assert cache.compressor_state(1).kv.shape == (1, 2, cfg.head_dim)
    assert cache.engram_lookback is None                      # no Engram layers in this config


def test_v41_engram_lookback_per_slot() -> None:
    d = tiny_config_dict(model_type="deepseek_v41", num_hidden_layers=2, compress_ratios=[0, 0],
                         engram_layer_ids=[1], engram_num_embeddings=[50],
                         engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=16,
                         engram_vocab_size=1000, engram_compressed_vocab_size=40)
    cfg = ModelConfig.from_dict(d)
    cache = HybridCache.allocate(cfg, 1, 3, 128, torch.float32)
    assert cache.engram_lookback.shape == (3, 2) and cache.engram_lookback.dtype == torch.int64
    cache.engram_lookback.fill_(7)
    cache.reset_slots([1])
    assert cache.engram_lookback.tolist() == [[7, 7], [-1, -1], [7, 7]]  # DEAD (docs/V41.md)
    per_slot = HybridCache.bytes_per_slot(cfg, torch.float32)
    assert per_slot == 2 * cfg.window_size * cfg.head_dim * 4 + 2 * 8
    assert cache.memory_bytes() == 3 * per_slot
