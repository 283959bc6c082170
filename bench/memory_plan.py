"""Per-GPU memory plan of a DeepSeek-V4 / V4.1 deployment (tensor parallel attention, expert
parallel MoE): weights, cache, fixed per-request state, activations, CUDA graphs, headroom.

    python bench/memory_plan.py --model flash --gpus 2 --ep --context 8192 --concurrency 1,16,64
    python bench/memory_plan.py --model pro   --gpus 8 --ep --context 8192 --concurrency 1,16,64
    python bench/memory_plan.py --model v41   --gpus 8 --ep --context 8192 --concurrency 1,16,64
    python bench/memory_plan.py --config /path/to/config.json --gpus 8 --ep ...

Computed, not measured: nothing here touches a GPU.  The sources of each number:

* weights: ``dsv4.checkpoint.expected_tensors`` (every official tensor with its format) cut by
  ``dsv4.dist.sharding.shard_plan`` (the slices each rank loads), held in the dtypes the dsv4
  modules keep on CUDA (``HELD_AS``: a few tensors are held wider than the checkpoint stores them);
* cache: per layer from the config, in the official record formats (``--kv-cache-dtype fp8``) or
  in what ``HybridCache`` allocates today (``bf16``; equal to ``HybridCache.bytes_per_page`` /
  ``bytes_per_slot``).  Attention is tensor parallel over query heads with one shared KV latent,
  so every rank holds the whole cache;
* activations: an analytic upper bound per token of one step (``activation_bytes``), plus
  fixed allowances for the CUDA context / NCCL / workspaces and the CUDA-graph pool.

The budget is ``--util`` (0.9) of the device's total memory (H200: 143,771 MiB, what
``torch.cuda.mem_get_info`` reports), as the engine's ``gpu_memory_utilization`` does.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dsv4.cache.tensors import compressor_specs
from dsv4.checkpoint import TensorShard, TensorSpec, expected_tensors
from dsv4.config import ModelConfig
from dsv4.dist.parallel import Parallel, ParallelConfig
from dsv4.dist.sharding import shard_plan

__all__ = ["GIB", "H200_TOTAL_BYTES", "WeightPlan", "CacheFormat", "CachePlan", "Allowances",
           "load_named_config", "weight_plan", "cache_plan", "activation_bytes", "step_tokens",
           "plan_total", "max_concurrency", "main"]

GIB = 1 << 30
MIB = 1 << 20
H200_TOTAL_BYTES = 143_771 * MIB  # nvidia-smi / mem_get_info total of the lent H200 (GPU.md)
NAMED_MODELS = ("flash", "flash-base", "pro", "v41")
_REAL_CONFIGS = (Path(__file__).resolve().parents[1] / "tests" / "checkpoint"
                 / "ckpt_real_configs.py")


# ---------------------------------------------------------------------------------- configs
def load_named_config(name: str) -> ModelConfig:
    """The real config of ``name`` (flash, flash-base, pro, v41), from the repository's copy of
    the official config.json values (tests/checkpoint/ckpt_real_configs.py, spec §1)."""
    if name not in NAMED_MODELS:
        raise ValueError(f"--model {name!r} is not known; allowed: {NAMED_MODELS} "
                         f"(or --config a config.json)")
    spec = importlib.util.spec_from_file_location("ckpt_real_configs", _REAL_CONFIGS)
    if spec is None or spec.loader is None or not _REAL_CONFIGS.is_file():
        raise FileNotFoundError(f"real configs not found at {_REAL_CONFIGS}; pass --config")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = {"flash": lambda: mod.V4_FLASH, "flash-base": mod.v4_flash_base, "pro": mod.v4_pro,
            "v41": lambda: mod.V41_FLASH}[name]()
    return ModelConfig.from_dict(data)


# ---------------------------------------------------------------------------------- weights
# Kinds, first match wins (official names; ``mtp.{k}.`` stages fall into the same kinds).
WEIGHT_KINDS: tuple[tuple[str, str, str], ...] = (
    ("engram_table", r"\.engram\.embed\.weight$", "Engram tables (mxfp8)"),
    ("engram_proj", r"\.engram\.", "Engram projections"),
    ("routed_experts", r"\.ffn\.experts\.", "routed experts"),
    ("shared_expert", r"\.ffn\.shared_experts\.", "shared expert (fp8)"),
    ("gate", r"\.ffn\.gate\.", "router gates"),
    ("attn_split", r"\.attn\.(wq_b\.weight|wo_a\.weight|wo_b\.weight|attn_sink)$",
     "attention wq_b/wo_a/wo_b/sink"),
    ("compressor_indexer", r"\.attn\.(compressor|indexer)\.", "compressor + indexer"),
    ("attn_rest", r"\.attn\.", "attention wq_a/wkv/norms"),
    ("mhc", r"(^|\.)hc_", "mHC (fp32)"),
    ("embed_head", r"^(embed|head)\.weight$", "embedding + head"),
    ("norms", r"(^|\.)(attn_norm|ffn_norm|norm)\.weight$", "block norms"),
    ("mtp_extra", r"^mtp\.", "MTP / DSpark projections"),
)
_KIND_RES = tuple((k, re.compile(p)) for k, p, _ in WEIGHT_KINDS)
KIND_TITLES = {k: t for k, _, t in WEIGHT_KINDS}

# Tensors the dsv4 modules hold in another dtype than the checkpoint's (bytes per logical
# element); everything else is held as stored (FP8 / MXFP4 with their scales, bf16, fp32).
# tests/bench/test_memory_plan.py checks these against a model built with quantized storage.
HELD_AS: tuple[tuple[str, int, str], ...] = (
    (r"\.attn\.wo_a\.weight$", 2, "wo_a dequantized to bf16 (reference convert.py)"),
    (r"(^|\.)\w*norm\.weight$", 4, "RMSNorm weights held in fp32"),
)
_HELD_RES = tuple((re.compile(p), b) for p, b, _ in HELD_AS)


def held_elem_bytes(cfg: ModelConfig, name: str) -> int | None:
    """Bytes per logical element dsv4 holds ``name`` in when that differs from the checkpoint
    format (:data:`HELD_AS`), else None."""
    for rx, per_elem in _HELD_RES:
        if rx.search(name):
            return per_elem
    return None


def weight_kind(name: str) -> str:
    """The plan's kind of official tensor ``name`` (a key of :data:`KIND_TITLES`)."""
    for kind, rx in _KIND_RES:
        if rx.search(name):
            return kind
    raise ValueError(f"memory plan: tensor {name!r} matches no weight kind")


def _granularity(spec: TensorSpec, dim: int) -> int:
    # fp8: block × block scales; fp4 / mxfp8: one scale per row and 32 columns.
    if spec.fmt == "fp8":
        return spec.block
    return 1 if dim == 0 else spec.block


def stored_bytes(spec: TensorSpec, piece: TensorShard | None = None) -> int:
    """Checkpoint bytes (weight + ``.scale``) of ``spec``, or of the slice ``piece`` of it."""
    item = spec.dtype.itemsize
    stored = list(spec.stored_shape)
    scale = list(spec.scale_shape) if spec.scale_shape is not None else None
    if piece is not None:
        d, lo, hi = piece.dim, piece.start, piece.stop
        full = spec.shape[d]
        if (stored[d] * (hi - lo)) % full:
            raise ValueError(f"memory plan: slice [{lo}, {hi}) of {spec.name} dim {d} does not "
                             f"cut its stored shape {spec.stored_shape} evenly")
        stored[d] = stored[d] * (hi - lo) // full
        if scale is not None:
            g = _granularity(spec, d)
            scale[d] = -(-hi // g) - lo // g
    total = math.prod(stored) * item
    if scale is not None:
        total += math.prod(scale) * spec.scale_dtype.itemsize  # type: ignore[union-attr]
    return total


def held_bytes(cfg: ModelConfig, spec: TensorSpec, piece: TensorShard | None = None) -> int:
    """Bytes dsv4 holds on CUDA for ``spec`` (or its slice): :data:`HELD_AS` widenings, else
    the checkpoint bytes."""
    per_elem = held_elem_bytes(cfg, spec.name)
    if per_elem is None:
        return stored_bytes(spec, piece)
    numel = math.prod(spec.shape)
    if piece is not None:
        numel = numel * (piece.stop - piece.start) // spec.shape[piece.dim]
    return numel * per_elem


def loaded_bytes(spec: TensorSpec, piece: TensorShard | None, kind: str) -> int:
    """Bytes of ``spec`` (or its slice) as ``load_checkpoint(keep_quantized=True)`` returns it
    that the model then copies into its own storage; 0 for FP8 ``Linear`` weights, which the
    model adopts as they are (``Linear._load_quantized``)."""
    if spec.fmt == "fp8" and kind != "routed_experts" and not spec.name.endswith("wo_a.weight"):
        return 0
    if spec.name.endswith("attn.wo_a.weight") or spec.fmt == "bf16":
        numel = math.prod(spec.shape)
        if piece is not None:
            numel = numel * (piece.stop - piece.start) // spec.shape[piece.dim]
        return numel * 2  # dense in the bf16 compute dtype
    return stored_bytes(spec, piece)


def streamed_copy_bytes(cfg: ModelConfig, spec: TensorSpec, piece: TensorShard | None,
                        kind: str) -> int:
    """Device bytes of ``spec`` (or its slice) as ``load_model`` streams it that live next to
    the model while it is put in place: 0 when the model adopts the value (FP8 ``Linear``
    weights, Engram tables, tensors held in their checkpoint dtype), the value itself when it
    is copied into a routed-expert stack or widened to fp32; for ``wo_a`` the FP8 value plus
    the fp32 temporaries of its block dequantization (weight, expanded scales, product)."""
    if kind == "routed_experts":
        return stored_bytes(spec, piece)
    if spec.name.endswith("attn.wo_a.weight"):
        numel = math.prod(spec.shape)
        if piece is not None:
            numel = numel * (piece.stop - piece.start) // spec.shape[piece.dim]
        return stored_bytes(spec, piece) + 12 * numel
    if spec.fmt == "bf16" and held_elem_bytes(cfg, spec.name) is not None:
        return stored_bytes(spec, piece)
    return 0


@dataclass
class WeightPlan:
    """Checkpoint totals by kind and, per rank, the bytes each kind holds there."""

    cfg: ModelConfig
    world_size: int
    expert_parallel: bool
    checkpoint: dict[str, int]               # kind -> checkpoint bytes (whole model)
    held_total: dict[str, int]               # kind -> held bytes, whole model, one copy
    per_rank_stored: list[dict[str, int]]    # rank -> kind -> checkpoint bytes on that rank
    per_rank_held: list[dict[str, int]]      # rank -> kind -> held bytes on that rank
    sharding: dict[str, str] = field(default_factory=dict)  # kind -> how it is split
    mtp_held: list[int] = field(default_factory=list)       # rank -> held bytes of mtp.*
    # rank -> bytes load_checkpoint returns onto the device that the model copies (rather than
    # adopts) into storage it allocated first: today's load_model holds both at once.
    load_copied: list[int] = field(default_factory=list)
    # rank -> the largest streamed_copy_bytes of one tensor on that rank.
    stream_extra: list[int] = field(default_factory=list)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(self.checkpoint.values())

    def rank_held(self, rank: int) -> int:
        return sum(self.per_rank_held[rank].values())

    @property
    def max_rank_held(self) -> int:
        return max(self.rank_held(r) for r in range(self.world_size))

    def load_peak(self, rank: int) -> int:
        """Device bytes at the peak of today's ``load_model`` on ``rank``: the model's own
        storage plus every loaded tensor it copies from (all read before any is copied)."""
        return self.rank_held(rank) + self.load_copied[rank]

    def stream_peak(self, rank: int) -> int:
        """Device bytes at the peak of ``load_model`` (a model built on ``meta``, the checkpoint
        streamed one tensor at a time): the held bytes plus the largest tensor not adopted."""
        return self.rank_held(rank) + self.stream_extra[rank]


def weight_plan(cfg: ModelConfig, world_size: int = 1, expert_parallel: bool = False
                ) -> WeightPlan:
    """Bytes of every weight kind on every rank of a ``world_size`` launch (shard_plan rules)."""
    if world_size < 1:
        raise ValueError(f"memory plan: world_size must be >= 1; got {world_size}")
    ParallelConfig(world_size, expert_parallel).check_model(cfg)
    specs = expected_tensors(cfg)
    kinds = {name: weight_kind(name) for name in specs}
    zero = {k: 0 for k in KIND_TITLES}
    checkpoint, held_total = dict(zero), dict(zero)
    full: dict[str, tuple[int, int, int]] = {}  # name -> (stored, held, load-copied) bytes
    mtp_total = copied_total = 0
    extra = {name: streamed_copy_bytes(cfg, spec, None, kinds[name])
             for name, spec in specs.items()}
    by_extra = sorted(extra, key=extra.__getitem__, reverse=True)
    for name, spec in specs.items():
        full[name] = (stored_bytes(spec), held_bytes(cfg, spec),
                      loaded_bytes(spec, None, kinds[name]))
        checkpoint[kinds[name]] += full[name][0]
        held_total[kinds[name]] += full[name][1]
        copied_total += full[name][2]
        if name.startswith("mtp."):
            mtp_total += full[name][1]
    per_stored: list[dict[str, int]] = []
    per_held: list[dict[str, int]] = []
    mtp_held: list[int] = []
    load_copied: list[int] = []
    stream_extra: list[int] = []
    split_kinds: dict[str, set[str]] = {k: set() for k in KIND_TITLES}
    for rank in range(world_size):
        plan = shard_plan(cfg, Parallel(rank=rank, world_size=world_size,
                                        expert_parallel=expert_parallel))
        # Start from the whole model and take off what the plan slices or drops.
        st, he, mtp, copied = dict(checkpoint), dict(held_total), mtp_total, copied_total
        # Largest whole tensor this rank loads (the first one the plan leaves whole), then the
        # slices.
        biggest = next((extra[n] for n in by_extra if n not in plan), 0)
        for name, piece in plan.items():
            if piece is not None:
                biggest = max(biggest, streamed_copy_bytes(cfg, specs[name], piece, kinds[name]))
            kind, spec = kinds[name], specs[name]
            split_kinds[kind].add("dropped" if piece is None else "sliced")
            s_full, h_full, c_full = full[name]
            s_part = h_part = c_part = 0
            if piece is not None:
                s_part, h_part = stored_bytes(spec, piece), held_bytes(cfg, spec, piece)
                c_part = loaded_bytes(spec, piece, kind)
            st[kind] += s_part - s_full
            he[kind] += h_part - h_full
            copied += c_part - c_full
            if name.startswith("mtp."):
                mtp += h_part - h_full
        per_stored.append(st)
        per_held.append(he)
        mtp_held.append(mtp)
        load_copied.append(copied)
        stream_extra.append(biggest)
    sharding = {k: _describe_split(k, split_kinds[k], cfg, world_size, expert_parallel)
                for k in KIND_TITLES}
    return WeightPlan(cfg, world_size, expert_parallel, checkpoint, held_total, per_stored,
                      per_held, sharding, mtp_held, load_copied, stream_extra)


def _describe_split(kind: str, how: set[str], cfg: ModelConfig, n: int, ep: bool) -> str:
    if n == 1 or not how:
        return "replicated" if n > 1 else "-"
    if kind == "routed_experts":
        return (f"EP: {cfg.n_routed_experts // n} experts / rank" if ep
                else f"TP: intermediate {cfg.moe_inter_dim // n} / rank")
    if kind == "attn_split":
        return f"TP: {cfg.n_heads // n} heads, {cfg.o_groups // n} o-group(s) / rank"
    if kind == "shared_expert":
        return ("TP: intermediate split" if "sliced" in how else "whole on rank 0")
    if kind == "engram_table":
        return "rows / rank (ceil)"
    return "sliced" if "sliced" in how else "rank 0 only"


# ---------------------------------------------------------------------------------- cache
@dataclass(frozen=True)
class CacheFormat:
    """Record bytes of one cache entry of each kind."""

    name: str
    window: int          # one window-ring row (per layer, per token in the window)
    compressed: int      # one compressed KV entry
    index_key: int       # one indexer key
    note: str = ""


def cache_format(cfg: ModelConfig, kv_cache_dtype: str = "fp8", index_keys: str = "auto"
                 ) -> CacheFormat:
    """Record sizes.  ``bf16``: what ``HybridCache`` allocates (2 bytes per channel).
    ``fp8``, the official formats stored for real (spec §2.5, §4.2-4.5, SERVING.md §1):

    * V4 window and compressed KV: 448 e4m3 NoPE + 64 bf16 RoPE + 7 ue8m0 scales + 1 pad = 584 B;
    * V4.1 window: all 512 channels e4m3 with a ue8m0 scale per 32 = 528 B; V4.1 compressed KV:
      e2m1 with an e4m3 scale per 16 = 288 B;
    * indexer keys (``index_keys``): ``fp8`` e4m3 + one fp32 scale = 132 B (vLLM's Hopper form),
      or ``fp4`` e2m1 + ue8m0 per 32 = 68 B (what the reference's fake quant keeps, and what
      ``HybridCache`` stores); ``auto``: fp4.
    """
    hd, rope, di = cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim
    if kv_cache_dtype == "bf16":
        return CacheFormat("bf16", 2 * hd, 2 * hd, 2 * di, "HybridCache today")
    if kv_cache_dtype != "fp8":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is invalid; allowed: fp8, bf16")
    if index_keys == "auto":
        index_keys = "fp4"
    if index_keys == "fp8":
        ik = di + 4
    elif index_keys == "fp4":
        ik = di // 2 + di // 32
    else:
        raise ValueError(f"--index-keys {index_keys!r} is invalid; allowed: auto, fp8, fp4")
    if cfg.is_v41:
        return CacheFormat("fp8", hd + hd // 32, hd // 2 + hd // 16, ik,
                           f"window e4m3/32, compressed e2m1/16, index keys {index_keys}")
    nope = hd - rope
    v4_record = nope + 2 * rope + -(-(nope // 64 + 1) // 8) * 8  # scales + pad to 8 bytes
    return CacheFormat("fp8", v4_record, v4_record, ik, f"fp8_ds_mla records, index keys "
                                                         f"{index_keys}")


def _owns_index_keys(cfg: ModelConfig, layer: int) -> bool:
    return layer in cfg.kv_source_layers if cfg.is_v41 else cfg.has_indexer(layer)


@dataclass
class CachePlan:
    """Per-rank cache sizes: paged (grows with tokens) and per request slot (fixed)."""

    fmt: CacheFormat
    page_size: int
    page_parts: dict[str, int]   # kind -> bytes per page (all layers)
    page_layers: dict[str, int]  # kind -> number of layers with that pool
    slot_parts: dict[str, int]   # kind -> bytes per request slot (all layers)

    @property
    def bytes_per_page(self) -> int:
        return sum(self.page_parts.values())

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_page / self.page_size

    @property
    def bytes_per_slot(self) -> int:
        return sum(self.slot_parts.values())

    def request_bytes(self, context: int) -> int:
        """Pages covering ``context`` tokens plus one state slot."""
        return -(-context // self.page_size) * self.bytes_per_page + self.bytes_per_slot


def cache_plan(cfg: ModelConfig, kv_cache_dtype: str = "fp8", index_keys: str = "auto",
               page_size: int = 256) -> CachePlan:
    """Cache bytes of the backbone layers (MTP / DSpark stages get no cache: no speculative
    decoding yet), in ``kv_cache_dtype`` records; compressor carry-over as HybridCache holds it
    (fp32 rows; V4's C128 in the compact float64 form unless DSV4_COMPACT_STATE=0)."""
    for r in cfg.all_ratios:
        if page_size <= 0 or page_size % r:
            raise ValueError(f"--page-size {page_size} must be a positive multiple of every "
                             f"compression ratio {cfg.all_ratios}")
    fmt = cache_format(cfg, kv_cache_dtype, index_keys)
    page: dict[str, int] = {}
    layers: dict[str, int] = {}
    for layer in range(cfg.n_layers):
        r = cfg.compressor_ratio(layer)
        if r <= 0:
            continue
        key = f"compressed KV r={r}"
        page[key] = page.get(key, 0) + (page_size // r) * fmt.compressed
        layers[key] = layers.get(key, 0) + 1
        if _owns_index_keys(cfg, layer):
            key = f"index keys r={r}"
            page[key] = page.get(key, 0) + (page_size // r) * fmt.index_key
            layers[key] = layers.get(key, 0) + 1
    slot = {"window ring": cfg.n_layers * cfg.window_size * fmt.window}
    # CompressorSpec.state_bytes: what HybridCache allocates (the compact C128 form included).
    carry = sum(s.state_bytes for layer in range(cfg.n_layers)
                for s in compressor_specs(cfg, layer))
    slot["compressor carry-over"] = carry
    if cfg.is_v41 and cfg.engram_layer_ids:
        slot["Engram lookback (int64)"] = (cfg.engram_max_ngram_size - 1) * 8
    return CachePlan(fmt, page_size, page, layers, slot)


# ---------------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class Allowances:
    """Memory that is neither weights nor cache (bytes).  ``runtime``: CUDA context, cuBLAS /
    Triton workspaces, NCCL buffers and allocator slack; ``cuda_graphs``: bookkeeping of the
    captured decode graphs (their activations share one pool, counted in the activations)."""

    runtime: int = int(2.0 * GIB)
    cuda_graphs: int = int(1.0 * GIB)
    max_batched_tokens: int = 2048  # the engine's max_num_batched_tokens (prefill chunk)


def activation_bytes(cfg: ModelConfig, world_size: int, expert_parallel: bool, tokens: int,
                     num_logits: int, context: int) -> int:
    """Upper bound of the activation bytes of one step of ``tokens`` tokens on one rank.

    Every term of one layer is counted as if alive at once (they are not), in the GPU path
    (bf16 compute, Triton sparse attention and indexer kernels: no gathered KV copies):
    the mHC residual streams (bf16 in / out, fp32 mixing copies), this rank's query and output
    heads, the compressor's fp32 rows, the indexer's query and fp32 scores over ``context``
    entries, the routed rows of the MoE (worst case: every one of a token's experts local) and
    the shared expert; plus ``num_logits`` fp32 logits rows twice (logits, sampler).
    """
    n = world_size
    d, hc = cfg.dim, cfg.hc_mult
    heads = cfg.n_heads // n
    residual = hc * d * (2 + 2 + 4 + 4)
    attn = heads * cfg.head_dim * 2 * 4 + (cfg.o_groups // n) * cfg.o_lora_rank * 2 * 2
    attn += (cfg.q_lora_rank + cfg.head_dim) * 4 * 2
    ratios = [cfg.compressor_ratio(layer) for layer in range(cfg.n_layers)]
    compress = max((2 * 2 * 2 * cfg.head_dim * 4 for r in ratios if r > 0), default=0)
    min_ratio = min((cfg.ratio(layer) for layer in range(cfg.n_layers) if cfg.ratio(layer) > 0),
                    default=0)
    index = 0
    if min_ratio:
        entries = -(-context // min_ratio)
        index = (cfg.index_n_heads * cfg.index_head_dim * 2 * 2 + cfg.index_n_heads * 4
                 + entries * 4 * 2 + cfg.index_topk * 8 * 2)
    if expert_parallel:
        local_experts = cfg.n_routed_experts // n
        rows, inter = min(cfg.n_activated_experts, local_experts), cfg.moe_inter_dim
    else:
        rows, inter = cfg.n_activated_experts, cfg.moe_inter_dim // n
    moe = rows * (3 * inter * 2 + d * 2) + d * 4 + 3 * (cfg.moe_inter_dim // n) * 2
    per_token = residual + attn + compress + index + moe
    if cfg.is_v41 and cfg.engram_layer_ids:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        per_token += cols * cfg.engram_head_dim * 2 * 2 + d * (hc + 1) * 4
    return tokens * per_token + num_logits * cfg.vocab_size * 4 * 2


def step_tokens(allow: Allowances, concurrency: int) -> int:
    """Tokens of the largest step: a prefill chunk, or a decode step of every request."""
    return max(allow.max_batched_tokens, concurrency)


# ---------------------------------------------------------------------------------- totals
def plan_total(wp: WeightPlan, cp: CachePlan, allow: Allowances, context: int,
               concurrency: int) -> dict[str, int]:
    """The per-GPU lines of the plan (worst rank) for ``concurrency`` requests of ``context``."""
    pages = -(-context // cp.page_size) * concurrency
    act = activation_bytes(wp.cfg, wp.world_size, wp.expert_parallel,
                           step_tokens(allow, concurrency), concurrency, context)
    lines = {
        "weights": wp.max_rank_held,
        "cache pages": pages * cp.bytes_per_page,
        "request state slots": concurrency * cp.bytes_per_slot,
        "activations (peak step)": act,
        "CUDA graphs": allow.cuda_graphs,
        "runtime (context, NCCL, workspaces)": allow.runtime,
    }
    lines["total"] = sum(lines.values())
    return lines


def max_concurrency(wp: WeightPlan, cp: CachePlan, allow: Allowances, context: int,
                    budget: int, limit: int = 1 << 16) -> int:
    """The most requests of ``context`` tokens whose plan total fits in ``budget`` (0 if none)."""
    lo, hi = 0, limit
    while lo < hi:  # the total grows with concurrency: bisect
        mid = (lo + hi + 1) // 2
        if plan_total(wp, cp, allow, context, mid)["total"] <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------------------------- report
def _g(b: float) -> str:
    return f"{b / GIB:.2f}"


def report(cfg: ModelConfig, label: str, world_size: int, ep: bool, context: int,
           concurrencies: list[int], kv_cache_dtype: str, index_keys: str, page_size: int,
           allow: Allowances, total_bytes: int, util: float) -> str:
    """The plan as markdown tables."""
    wp = weight_plan(cfg, world_size, ep)
    cp = cache_plan(cfg, kv_cache_dtype, index_keys, page_size)
    cp16 = cache_plan(cfg, "bf16", index_keys, page_size)
    budget = int(total_bytes * util)
    out: list[str] = []
    w = out.append
    par = f"TP{world_size}" + ("+EP" if ep and world_size > 1 else "")
    w(f"## {label}: {par} on {world_size} GPU(s), context {context}, "
      f"kv-cache {kv_cache_dtype}")
    w("")
    w(f"Weights: checkpoint {_g(wp.checkpoint_bytes)} GiB; held by dsv4 (one copy) "
      f"{_g(sum(wp.held_total.values()))} GiB. Per GPU (rank 0; worst rank "
      f"{_g(wp.max_rank_held)} GiB):")
    w("")
    w("| kind | checkpoint GiB | held/GPU GiB | split |")
    w("|---|---:|---:|---|")
    fmt_expert = "fp4" if cfg.expert_dtype == "fp4" else cfg.expert_dtype
    for k, title in KIND_TITLES.items():
        if not wp.checkpoint[k]:
            continue
        if k == "routed_experts":
            title = f"{title} ({fmt_expert})"
        w(f"| {title} | {_g(wp.checkpoint[k])} | {_g(wp.per_rank_held[0][k])} | "
          f"{wp.sharding[k]} |")
    w(f"| **total** | **{_g(wp.checkpoint_bytes)}** | **{_g(wp.rank_held(0))}** | "
      f"of which MTP/DSpark stages {_g(wp.mtp_held[0])} |")
    spread = max(wp.rank_held(r) for r in range(world_size)) - min(
        wp.rank_held(r) for r in range(world_size))
    if world_size > 1:
        w("")
        w(f"Ranks differ by at most {spread:,} bytes (shared expert / Engram row remainders).")
    widened = sum(wp.held_total.values()) - wp.checkpoint_bytes
    w("")
    w(f"Held wider than stored (+{_g(widened)} GiB over the whole model): wo_a bf16, norms "
      f"fp32 (the head, the compressor projections and the gate stay bf16: fp32 math on their "
      f"bf16 values).")
    peak = max(wp.stream_peak(r) for r in range(world_size))
    verdict = ("fits under" if peak <= total_bytes else "**exceeds**")
    w(f"Load peak of `load_model` (model built on `meta`, checkpoint streamed one tensor at a "
      f"time): {_g(peak)} GiB on the worst rank (held + {_g(max(wp.stream_extra))} GiB), which "
      f"{verdict} the device's {_g(total_bytes)} GiB.")
    w("")
    w(f"Cache per GPU (every rank holds the whole cache: one KV latent shared by all heads). "
      f"Records: {cp.fmt.note}; page = {page_size} tokens.")
    w("")
    w(f"| paged kind | layers | B/token {kv_cache_dtype} | B/token bf16 | "
      f"B/page {kv_cache_dtype} | B/page bf16 |")
    w("|---|---:|---:|---:|---:|---:|")
    for k in cp.page_parts:
        w(f"| {k} | {cp.page_layers[k]} | {cp.page_parts[k] / page_size:.1f} | "
          f"{cp16.page_parts[k] / page_size:.1f} | {cp.page_parts[k]} | {cp16.page_parts[k]} |")
    w(f"| **all** | | **{cp.bytes_per_token:.1f}** | **{cp16.bytes_per_token:.1f}** | "
      f"**{cp.bytes_per_page}** | **{cp16.bytes_per_page}** |")
    w("")
    w(f"| per-request state | KiB {kv_cache_dtype} | KiB bf16 |")
    w("|---|---:|---:|")
    for k in cp.slot_parts:
        w(f"| {k} | {cp.slot_parts[k] / 1024:.2f} | {cp16.slot_parts[k] / 1024:.2f} |")
    w(f"| **all** | **{cp.bytes_per_slot / 1024:.1f}** | **{cp16.bytes_per_slot / 1024:.1f}** |")
    w(f"| one request of {context} tokens (pages + state) | {cp.request_bytes(context) / 1024:.0f} "
      f"| {cp16.request_bytes(context) / 1024:.0f} |")
    w("")
    w(f"Per-GPU totals (GiB), budget {util} x {_g(total_bytes)} GiB = {_g(budget)} GiB; "
      f"activations for steps of max({allow.max_batched_tokens}, concurrency) tokens:")
    w("")
    head = "| line | " + " | ".join(f"C={c}" for c in concurrencies) + " |"
    w(head)
    w("|---|" + "---:|" * len(concurrencies))
    totals = [plan_total(wp, cp, allow, context, c) for c in concurrencies]
    for line in totals[0]:
        cells = " | ".join(_g(t[line]) for t in totals)
        w(f"| {'**total**' if line == 'total' else line} | {cells} |")
    w("| headroom | " + " | ".join(_g(budget - t["total"]) for t in totals) + " |")
    c_max = max_concurrency(wp, cp, allow, context, budget)
    w("")
    line = (f"Largest concurrency at {context} tokens that fits: **{c_max}** with the "
            f"{kv_cache_dtype} cache")
    if kv_cache_dtype != "bf16":
        line += f" ({max_concurrency(wp, cp16, allow, context, budget)} with the bf16 cache)"
    w(line + ".")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=NAMED_MODELS, help="a real config (spec §1)")
    src.add_argument("--config", help="a config.json (or checkpoint directory)")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs of the tensor-parallel group")
    ap.add_argument("--tp", type=int, default=None, help="tensor parallel size (= --gpus)")
    ap.add_argument("--ep", action="store_true", help="expert parallel MoE (whole experts/rank)")
    ap.add_argument("--context", type=int, default=8192, help="tokens held per request")
    ap.add_argument("--concurrency", default="1,16,64", help="comma list of request counts")
    ap.add_argument("--kv-cache-dtype", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--index-keys", choices=("auto", "fp8", "fp4"), default="auto",
                    help="indexer key record with --kv-cache-dtype fp8: 132 B or 68 B "
                         "(auto: fp4, what HybridCache stores)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=Allowances.max_batched_tokens)
    ap.add_argument("--runtime-gib", type=float, default=Allowances.runtime / GIB)
    ap.add_argument("--graphs-gib", type=float, default=Allowances.cuda_graphs / GIB)
    ap.add_argument("--gpu-mib", type=int, default=H200_TOTAL_BYTES // MIB,
                    help="total memory of one GPU in MiB (H200: 143771)")
    ap.add_argument("--util", type=float, default=0.9, help="fraction of it the plan may use")
    args = ap.parse_args(argv)
    tp = args.gpus if args.tp is None else args.tp
    if args.gpus < 1 or tp != args.gpus:
        ap.error(f"--tp {tp} must equal --gpus {args.gpus} (one tensor-parallel group spans "
                 f"every GPU; for data-parallel replicas plan one replica)")
    if args.context < 1:
        ap.error(f"--context must be positive; got {args.context}")
    try:
        conc = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency {args.concurrency!r}: expected integers separated by commas")
    if not conc or min(conc) < 1:
        ap.error(f"--concurrency {args.concurrency!r}: expected positive integers")
    if not 0 < args.util <= 1:
        ap.error(f"--util must be in (0, 1]; got {args.util}")
    cfg = load_named_config(args.model) if args.model else ModelConfig.from_file(args.config)
    label = {"flash": "V4-Flash", "flash-base": "V4-Flash-Base", "pro": "V4-Pro",
             "v41": "V4.1-Flash"}.get(args.model or "", args.config or "")
    allow = Allowances(int(args.runtime_gib * GIB), int(args.graphs_gib * GIB),
                       args.max_batched_tokens)
    try:
        text = report(cfg, label, args.gpus, args.ep, args.context, conc, args.kv_cache_dtype,
                      args.index_keys, args.page_size, allow, args.gpu_mib * MIB, args.util)
    except ValueError as e:
        print(f"memory_plan: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
