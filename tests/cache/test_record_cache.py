"""HybridCache with record pools (kv_cache_dtype "fp8"): shapes, byte counts against the
published record sizes, slot resets, and the engine's choice of cache dtype."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.formats import RECORD_DTYPE, cache_formats
from dsv4.cache.tensors import HybridCache
from dsv4.config import ModelConfig
from dsv4.engine.runner import resolve_cache_dtype
from dsv4.tiny import tiny_config


def _v4(**kw) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config("v4", **kw))   # ratios 0, 4, 128, 4, 128


def _v41(**kw) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config("v41", **kw))  # ratios 0,0,2,2,1,1,1,1; sources 2, 4


def test_v4_record_pools_shapes_and_memory() -> None:
    cfg = _v4()                                             # head_dim 128, rope 64, dI 128
    cache = HybridCache.allocate(cfg, num_pages=3, num_slots=2, page_size=256, dtype=RECORD_DTYPE)
    rec, key = 64 + 128 + 8, 64 + 4
    assert cache.records and cache.window_format is cache.compressed_format
    assert cache.window_format.record_bytes == rec
    assert cache.index_key_format.record_bytes == key
    ring = cache.window_ring(0)
    assert ring.dtype == torch.uint8 and ring.shape == (2, cfg.window_size, rec)
    assert cache.compressed_pool(1).shape == (3, 64, rec)
    assert cache.compressed_pool(2).shape == (3, 2, rec)
    assert cache.index_key_pool(3).shape == (3, 64, key) and 2 not in cache.index_keys
    state = cache.compressor_state(1, "attn")
    assert state.kv.dtype == torch.float32              # carry-over stays fp32
    per_page = HybridCache.bytes_per_page(cfg, 256, RECORD_DTYPE)
    assert per_page == 2 * 64 * (rec + key) + 2 * 2 * rec
    per_slot = HybridCache.bytes_per_slot(cfg, RECORD_DTYPE)
    assert cache.memory_bytes() == 3 * per_page + 2 * per_slot
    dense = HybridCache.allocate(cfg, 3, 2, 256, torch.bfloat16)
    assert dense.window_format is None and not dense.records
    assert per_page < HybridCache.bytes_per_page(cfg, 256, torch.bfloat16)


def test_real_shapes_shrink_as_published() -> None:
    # V4-Flash-shaped heads: one compressed entry 584 B against 1024 B in bf16; index keys
    # 68 B against 256 B.
    cfg = _v4(head_dim=512)
    fm = cache_formats(cfg)
    assert fm.compressed.record_bytes == 584 and fm.index_keys.record_bytes == 68
    got = HybridCache.bytes_per_page(cfg, 256, RECORD_DTYPE)
    bf16 = HybridCache.bytes_per_page(cfg, 256, torch.bfloat16)
    assert got == 2 * 64 * (584 + 68) + 2 * 2 * 584
    assert bf16 == 2 * 64 * (1024 + 256) + 2 * 2 * 1024
    slot, slot_bf16 = (HybridCache.bytes_per_slot(cfg, d) for d in (RECORD_DTYPE, torch.bfloat16))
    assert slot_bf16 - slot == 5 * cfg.window_size * (1024 - 584)
    # V4.1-Flash-shaped: window 528 B, compressed 288 B, keys 68 B.
    cfg41 = _v41(head_dim=512, index_head_dim=128)
    fm41 = cache_formats(cfg41)
    assert (fm41.window.record_bytes, fm41.compressed.record_bytes,
            fm41.index_keys.record_bytes) == (528, 288, 68)
    # KV sources 2 (ratio 2: 128 entries per page) and 4 (ratio 1: 256) own pool + keys.
    assert HybridCache.bytes_per_page(cfg41, 256, RECORD_DTYPE) == (128 + 256) * (288 + 68)


def test_v41_record_pools_follow_the_sources() -> None:
    cfg = _v41()
    cache = HybridCache.allocate(cfg, 2, 1, 16, RECORD_DTYPE)
    assert sorted(cache.compressed) == [2, 4] and sorted(cache.index_keys) == [2, 4]
    assert cache.compressed_pool(3) is cache.compressed[2]
    assert cache.compressed_pool(3).shape == (2, 8, cfg.head_dim // 2 + cfg.head_dim // 16)
    assert cache.window_ring(7).shape == (1, cfg.window_size, cfg.head_dim + cfg.head_dim // 32)


def test_reset_slots_clears_record_rings() -> None:
    cache = HybridCache.allocate(_v4(), 1, 3, 256, RECORD_DTYPE)
    for ring in cache.window.values():
        ring.fill_(7)
    cache.reset_slots([0, 2])
    ring = cache.window_ring(4)
    assert (ring[[0, 2]] == 0).all() and (ring[1] == 7).all()


def test_engine_cache_dtype_choice() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_cache_dtype("fp8", torch.float32, cpu) == RECORD_DTYPE
    assert resolve_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_cache_dtype("auto", torch.bfloat16, cuda) == RECORD_DTYPE
    assert resolve_cache_dtype("bf16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="needs dtype=bfloat16"):
        resolve_cache_dtype("bf16", torch.float32, cpu)
    with pytest.raises(ValueError, match="'int8' is invalid"):
        resolve_cache_dtype("int8", torch.float32, cpu)
