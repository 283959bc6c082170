"""Helpers shared by the attention tests (tiny configs, random init, step runners), plus checks
of the helpers themselves."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dsv4.cache.tensors import HybridCache
from dsv4.config import ModelConfig
from dsv4.model.attention import Attention
from dsv4.model.context import StepContext
from dsv4.ops import get_ops

PAGE = 128          # smallest page that holds whole ratio-128 groups
WINDOW = 8
LAYER_SWA, LAYER_CSA, LAYER_HCA = 0, 1, 2


def tiny_config_dict(**overrides: Any) -> dict:
    """A tiny V4 config.json (HF keys): D 256, 4 heads × 128, rope 64, window 8, ratios 0/4/128,
    index_topk 4 with 32 index heads (≥ 32 heads avoids exact score ties, spec §6.13)."""
    d = dict(
        model_type="deepseek_v4", vocab_size=64, hidden_size=256, num_hidden_layers=3,
        num_attention_heads=4, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2,
        o_lora_rank=128, moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
        compress_ratios=[0, 4, 128], sliding_window=WINDOW, index_n_heads=32, index_head_dim=128,
        index_topk=4, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=64,
                          beta_fast=32, beta_slow=1),
        num_nextn_predict_layers=0, max_position_embeddings=4096)
    d.update(overrides)
    return d


def tiny_config(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict(**overrides))


def init_attention(att: torch.nn.Module, seed: int) -> None:
    """Deterministic random parameters with sane scales (outputs of order 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(att.named_parameters()):
            if p.dim() == 2 and not name.endswith("ape"):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # attn_sink, ape
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def make_attention(layer: int, numerics: str = "bf16", seed: int = 0,
                   dtype: torch.dtype = torch.float32, cfg: ModelConfig | None = None
                   ) -> Attention:
    cfg = cfg or tiny_config()
    att = Attention(cfg, layer, numerics, get_ops("torch"), dtype)
    init_attention(att, seed)
    return att


def new_cache(att: Attention, num_pages: int = 8, num_slots: int = 4,
              page_size: int = PAGE) -> HybridCache:
    device = att.attn_sink.device
    return HybridCache.allocate(att.cfg, num_pages, num_slots, page_size, att.dtype, device)


def run_chunks(att: Attention, x: torch.Tensor, sizes: Sequence[int], cache: HybridCache,
               slot: int = 0, pages: Sequence[int] | None = None) -> torch.Tensor:
    """Feed the rows of x (one request) in chunks of ``sizes`` (the last repeats); returns the
    concatenated outputs."""
    pages = list(range(cache.num_pages)) if pages is None else list(pages)
    outs, pos, k = [], 0, 0
    while pos < x.shape[0]:
        n = min(sizes[min(k, len(sizes) - 1)], x.shape[0] - pos)
        ids = torch.zeros(n, dtype=torch.long, device=x.device)
        ctx = StepContext.build(ids, [n], [pos], [slot], [pages])
        outs.append(att(x[pos:pos + n], ctx, cache))
        pos, k = pos + n, k + 1
    return torch.cat(outs)


def test_tiny_config_layers() -> None:
    cfg = tiny_config()
    assert [cfg.attn_mode(i) for i in range(3)] == ["swa", "csa", "hca"]
    att = make_attention(LAYER_CSA)
    names = {n for n, _ in att.named_parameters()}
    for want in ("wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight",
                 "wo_a.weight", "wo_b.weight", "attn_sink", "compressor.wkv.weight",
                 "compressor.wgate.weight", "compressor.ape", "compressor.norm.weight",
                 "indexer.wq_b.weight", "indexer.weights_proj.weight",
                 "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight",
                 "indexer.compressor.ape", "indexer.compressor.norm.weight"):
        assert want in names, want
    assert len(names) == 18
