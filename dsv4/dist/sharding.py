"""Which part of each checkpoint tensor a rank loads (the shard plan).

Tensor parallel attention (every backbone layer and MTP / DSpark stage): query heads
``[r·H/n, (r+1)·H/n)`` — ``wq_b`` rows by head, ``attn_sink`` by head — output groups
``[r·G/n, (r+1)·G/n)`` — ``wo_a`` rows by group, ``wo_b`` the matching input columns (its
partial outputs are summed by an all-reduce).  ``wq_a``, ``wkv``, the norms, the compressor and
the indexer are replicated: the latents and the caches are the same on every rank.

MoE: the shared expert is split along its intermediate dim (``w1``/``w3`` rows, ``w2``
columns) when the slices fall on its FP8 scale blocks (so each rank keeps FP8 weights and the
activation blocks of the reference); otherwise rank 0 holds it whole and the other ranks add
nothing.  Routed experts: with ``expert_parallel`` rank r holds whole experts
``[r·E/n, (r+1)·E/n)`` and loads no other expert; without it, every expert is split along its
intermediate dim (``ParallelConfig.check_model`` requires block-aligned slices).  One
all-reduce sums routed + shared partials.

V4.1 Engram tables: rows ``[r·c, (r+1)·c)`` with ``c = ceil(rows/n)``; a lookup of a row held
elsewhere gives zeros, and an all-reduce completes the rows.

Embedding, head, mHC, gates, Engram projections: replicated (the V4-Flash embedding and head
are ~1 GB and ~2 GB, small next to the experts).
"""

from __future__ import annotations

import re

from dsv4.checkpoint import TensorShard, expected_tensors
from dsv4.config import ModelConfig
from dsv4.dist.parallel import Parallel

__all__ = ["shard_plan", "moe_expert_count", "splits_shared_expert"]

_ATTN = re.compile(r"^(?:layers|mtp)\.\d+\.attn\."
                   r"(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")
_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_SHARED = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.shared_experts\.(w1|w2|w3)\.weight$")
_ENGRAM = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")


def moe_expert_count(cfg: ModelConfig, is_mtp: bool) -> int:
    """Routed experts of a backbone layer (``is_mtp`` False) or an MTP / DSpark stage."""
    if cfg.is_v41 and is_mtp and cfg.dspark_n_routed_experts:
        return cfg.dspark_n_routed_experts
    return cfg.n_routed_experts


def splits_shared_expert(cfg: ModelConfig, world_size: int) -> bool:
    """True when the shared expert is split over ``world_size`` ranks, False when rank 0
    holds it whole (its slices would cut FP8 scale blocks)."""
    part = cfg.moe_inter_dim // world_size
    return not cfg.quantized or part % cfg.weight_block_size == 0


def shard_plan(cfg: ModelConfig, par: Parallel) -> dict[str, TensorShard | None]:
    """Official tensor name -> the slice this rank loads (logical coordinates), or None for a
    tensor it does not load at all (another rank's experts).  Names not in the plan load whole.
    Empty for a single process."""
    if par.world_size == 1:
        return {}
    h, g, hd, o_lora = cfg.n_heads, cfg.o_groups, cfg.head_dim, cfg.o_lora_rank
    h_lo, h_hi = par.split(h, "num_attention_heads")
    g_lo, g_hi = par.split(g, "o_groups")
    i_lo, i_hi = par.split(cfg.moe_inter_dim, "moe_intermediate_size")
    engram_rows = dict(zip((f"layers.{layer}.engram.embed.weight" for layer in
                            cfg.engram_layer_ids), cfg.engram_num_embeddings))
    split_shared = splits_shared_expert(cfg, par.world_size)
    plan: dict[str, TensorShard | None] = {}
    for name in expected_tensors(cfg):
        m = _ATTN.match(name)
        if m:
            what = m.group(1)
            if what == "wq_b.weight":
                plan[name] = TensorShard(0, h_lo * hd, h_hi * hd)
            elif what == "attn_sink":
                plan[name] = TensorShard(0, h_lo, h_hi)
            elif what == "wo_a.weight":
                plan[name] = TensorShard(0, g_lo * o_lora, g_hi * o_lora)
            else:
                plan[name] = TensorShard(1, g_lo * o_lora, g_hi * o_lora)
            continue
        m = _EXPERT.match(name)
        if m:
            if par.expert_parallel:
                n_exp = moe_expert_count(cfg, m.group(1) == "mtp")
                e_lo, e_hi = par.split(n_exp, "n_routed_experts")
                if not e_lo <= int(m.group(3)) < e_hi:
                    plan[name] = None
                continue
            plan[name] = _inter_split(m.group(4), i_lo, i_hi)
            continue
        m = _SHARED.match(name)
        if m:
            if split_shared:
                plan[name] = _inter_split(m.group(1), i_lo, i_hi)
            elif not par.is_driver:
                plan[name] = None
            continue
        if _ENGRAM.match(name):
            lo, hi = par.split_ceil(engram_rows[name])
            plan[name] = TensorShard(0, lo, hi)
    return plan


def _inter_split(which: str, lo: int, hi: int) -> TensorShard:
    # w1 / w3 are [I, D] (rows of the intermediate dim); w2 is [D, I] (its columns).
    return TensorShard(1 if which == "w2" else 0, lo, hi)
