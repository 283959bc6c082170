"""HybridCache: the device tensors of every cache kind (docs/ARCHITECTURE.md, spec Appendix A).

One logical page = ``page_size`` tokens; page id p addresses every paged pool at once:

* compressed KV of a layer with its own compressor (ratio r): ``[num_pages, page_size // r, hd]``;
  entry j of a request lives at page ``block_table[j // (page_size // r)]``, row
  ``j % (page_size // r)``;
* indexer keys (V4 CSA layers; V4.1 KV-source layers): ``[num_pages, page_size // r, dI]``.

Fixed-size per-request state, indexed by slot:

* window ring, every layer: ``[num_slots, window_size, hd]``, row = position % window;
* compressor carry-over per compressor: ``kv``/``score`` ``[num_slots, rows, coff·d]``, the score
  rows including the position bias ``ape`` and starting at −inf (kv at 0).  Raw form (fp32,
  rows = coff·r): rows ``[0:r]`` hold the previous complete group (overlapping ratio-4
  compressor only), rows ``[off : off + r]`` (off = r with overlap, else 0) the current partial
  group.  Compact form (float64, rows = 1; :attr:`CompressorSpec.compact`: non-overlapping
  compressors of ratio >= :data:`COMPACT_STATE_MIN_RATIO`, i.e. V4's C128): one pseudo-row
  summarizing the partial group's softmax (dsv4/ops/torch_compress.py header), 8 KiB instead
  of 512 KiB per request for a C128 layer;
* V4.1 Engram lookback (configs with Engram layers): ``engram_lookback`` [num_slots, m − 1]
  int64, the compressed ids of the last m − 1 tokens (m = engram_max_ngram_size); allocated and
  reset to DEAD (−1), the lookback of a sequence with nothing before it (docs/V41.md).

Layers that read another layer's pools (V4.1 reuse/reindex roles) look them up by the source
layer: ``compressed_pool(layer)`` / ``index_key_pool(layer)`` resolve the source through the
config.

Storage: with a float ``dtype`` every pool holds rows of that dtype.  ``dtype=RECORD_DTYPE``
(``torch.float8_e4m3fn``, kv_cache_dtype "fp8") stores the window rings, compressed pools and
index keys as uint8 records in the official formats (``dsv4.cache.formats``): the pools' last dim
is then the record width, ``window_format`` / ``compressed_format`` / ``index_key_format`` say
how to encode (``encode_rows``) and read (``rows_view``) them, and are None for float pools.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from dsv4.cache.formats import CacheFormats, RecordFormat, cache_formats, is_record_dtype
from dsv4.config import ModelConfig

__all__ = ["HybridCache", "CompressorSpec", "CompressorState", "compressor_specs",
           "COMPACT_STATE", "COMPACT_STATE_MIN_RATIO"]

# The compact carry-over form (one float64 pseudo-row per slot instead of r fp32 rows) for
# non-overlapping compressors of at least this ratio: V4's C128 (512 KiB -> 8 KiB per request
# and layer); V4.1's ratio-2 states stay raw (2 fp32 rows are smaller than a float64 one).
COMPACT_STATE_MIN_RATIO = 8
# DSV4_COMPACT_STATE=0 keeps raw rows for every compressor (read when this module is imported).
COMPACT_STATE = os.environ.get("DSV4_COMPACT_STATE", "1") != "0"

# dsv4.model.engram.DEAD: the compressed id of "nothing" (before the sequence, image tokens).
_ENGRAM_DEAD = -1


@dataclass(frozen=True)
class CompressorSpec:
    """Shape facts of one compressor: ``name`` is "attn" (the layer's KV compressor) or
    "index" (the V4 indexer's own compressor)."""

    name: str
    ratio: int
    dim: int
    overlap: bool

    @property
    def coff(self) -> int:
        return 2 if self.overlap else 1

    @property
    def compact(self) -> bool:
        """The carry-over is the compact float64 pseudo-row (non-overlapping, ratio >=
        :data:`COMPACT_STATE_MIN_RATIO`, unless ``DSV4_COMPACT_STATE=0``)."""
        return COMPACT_STATE and not self.overlap and self.ratio >= COMPACT_STATE_MIN_RATIO

    @property
    def state_rows(self) -> int:
        """Rows per slot of the carry-over state: 1 compact, else coff·r."""
        return 1 if self.compact else self.coff * self.ratio

    @property
    def state_width(self) -> int:
        return self.coff * self.dim

    @property
    def state_dtype(self) -> torch.dtype:
        """float64 for the compact form, else float32."""
        return torch.float64 if self.compact else torch.float32

    @property
    def state_bytes(self) -> int:
        """Bytes of one slot's carry-over (kv and score)."""
        item = 8 if self.compact else 4
        return 2 * self.state_rows * self.state_width * item

    @property
    def partial_offset(self) -> int:
        """First state row of the current partial group."""
        return self.ratio if self.overlap else 0


def compressor_specs(cfg: ModelConfig, layer: int) -> list[CompressorSpec]:
    """The compressors that layer ``layer`` owns (and so the carry-over states it needs)."""
    r = cfg.compressor_ratio(layer)
    if r <= 0:
        return []
    if cfg.is_v41:
        # V4.1 compressor v2: no overlap; ratio 1 keeps no state (every token is an entry).
        return [CompressorSpec("attn", r, cfg.head_dim, False)] if r > 1 else []
    specs = [CompressorSpec("attn", r, cfg.head_dim, r == 4)]
    if cfg.has_indexer(layer):
        specs.append(CompressorSpec("index", r, cfg.index_head_dim, True))
    return specs


def _owns_index_keys(cfg: ModelConfig, layer: int) -> bool:
    if cfg.is_v41:
        return layer in cfg.kv_source_layers
    return cfg.has_indexer(layer)


@dataclass
class CompressorState:
    """Carry-over rows of one compressor for every slot: fp32 raw rows, or the compact float64
    pseudo-row (``spec.compact``); the ops tell the forms apart by dtype."""

    spec: CompressorSpec
    kv: Tensor      # [num_slots, spec.state_rows, coff·d]
    score: Tensor   # [num_slots, spec.state_rows, coff·d], −inf where empty

    def reset(self, slots: Tensor) -> None:
        """Empty the slots (kv 0, score −inf: also the compact form's empty pseudo-row)."""
        self.kv.index_fill_(0, slots, 0.0)
        self.score.index_fill_(0, slots, float("-inf"))


class HybridCache:
    """All cache tensors of a model: paged pools, window rings and compressor states.

    Build with :meth:`allocate`.  ``layers`` are the layer ids that get caches (by default the
    backbone layers ``0 .. n_layers−1``; MTP/DSpark stage ids may be added).
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, num_slots: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 layers: Iterable[int] | None = None) -> None:
        if num_pages < 0 or num_slots <= 0:
            raise ValueError(f"HybridCache: need num_pages >= 0 and num_slots > 0; got "
                             f"num_pages={num_pages}, num_slots={num_slots}")
        _check_page_size(cfg, page_size)
        self.cfg = cfg
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = tuple(range(cfg.n_layers) if layers is None else layers)
        n_total = len(cfg.compress_ratios)
        for layer in self.layers:
            if not 0 <= layer < n_total:
                raise ValueError(f"HybridCache: layer id {layer} out of range 0..{n_total - 1}")
        W, hd = cfg.window_size, cfg.head_dim
        # Record pools: uint8 rows of each kind's record width; else rows of `dtype`.
        self.formats: CacheFormats | None = cache_formats(cfg) if is_record_dtype(dtype) else None
        fm = self.formats
        pool_dtype = torch.uint8 if fm is not None else dtype
        w_width = fm.window.record_bytes if fm else hd
        c_width = fm.compressed.record_bytes if fm else hd
        k_width = fm.index_keys.record_bytes if fm else cfg.index_head_dim
        kw = dict(dtype=pool_dtype, device=self.device)
        self.window: dict[int, Tensor] = {}
        self.compressed: dict[int, Tensor] = {}
        self.index_keys: dict[int, Tensor] = {}
        self.states: dict[tuple[int, str], CompressorState] = {}
        self.engram_lookback: Tensor | None = None
        if cfg.is_v41 and cfg.engram_layer_ids:
            self.engram_lookback = torch.full((num_slots, cfg.engram_max_ngram_size - 1),
                                              _ENGRAM_DEAD, dtype=torch.int64,
                                              device=self.device)
        for layer in self.layers:
            self.window[layer] = torch.zeros(num_slots, W, w_width, **kw)
            r = cfg.compressor_ratio(layer)
            if r > 0:
                self.compressed[layer] = torch.zeros(num_pages, page_size // r, c_width, **kw)
                if _owns_index_keys(cfg, layer):
                    self.index_keys[layer] = torch.zeros(num_pages, page_size // r, k_width,
                                                         **kw)
            for spec in compressor_specs(cfg, layer):
                shape = (num_slots, spec.state_rows, spec.state_width)
                sdt = spec.state_dtype
                self.states[(layer, spec.name)] = CompressorState(
                    spec,
                    torch.zeros(shape, dtype=sdt, device=self.device),
                    torch.full(shape, float("-inf"), dtype=sdt, device=self.device))

    # ------------------------------------------------------------------ construction / sizing
    @classmethod
    def allocate(cls, cfg: ModelConfig, num_pages: int, num_slots: int, page_size: int = 256,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 layers: Iterable[int] | None = None) -> "HybridCache":
        """Allocate every pool and state tensor (zeros; compressor scores −inf).

        ``dtype``: the rows' dtype, or ``RECORD_DTYPE`` (float8_e4m3fn) for the official record
        formats (kv_cache_dtype "fp8")."""
        return cls(cfg, num_pages, num_slots, page_size, dtype, device, layers)

    @staticmethod
    def _row_bytes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int, int]:
        """Bytes of one (window row, compressed entry, index key) in ``dtype``."""
        if is_record_dtype(dtype):
            fm = cache_formats(cfg)
            return (fm.window.record_bytes, fm.compressed.record_bytes,
                    fm.index_keys.record_bytes)
        item = torch.empty((), dtype=dtype).element_size()
        return cfg.head_dim * item, cfg.head_dim * item, cfg.index_head_dim * item

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int = 256,
                       dtype: torch.dtype = torch.bfloat16,
                       layers: Iterable[int] | None = None) -> int:
        """Bytes of one logical page summed over every paged pool (record bytes for
        ``RECORD_DTYPE``)."""
        _check_page_size(cfg, page_size)
        _, entry, key = HybridCache._row_bytes(cfg, dtype)
        total = 0
        for layer in (range(cfg.n_layers) if layers is None else layers):
            r = cfg.compressor_ratio(layer)
            if r > 0:
                total += (page_size // r) * entry
                if _owns_index_keys(cfg, layer):
                    total += (page_size // r) * key
        return total

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                       layers: Iterable[int] | None = None) -> int:
        """Bytes of one request's fixed-size state (window rings + compressor carry-over)."""
        window_row = HybridCache._row_bytes(cfg, dtype)[0]
        total = 0
        for layer in (range(cfg.n_layers) if layers is None else layers):
            total += cfg.window_size * window_row
            for spec in compressor_specs(cfg, layer):
                total += spec.state_bytes
        if cfg.is_v41 and cfg.engram_layer_ids:
            total += (cfg.engram_max_ngram_size - 1) * 8
        return total

    # ------------------------------------------------------------------ access
    @property
    def records(self) -> bool:
        """True when the pools hold official-format records (kv_cache_dtype "fp8")."""
        return self.formats is not None

    @property
    def window_format(self) -> RecordFormat | None:
        """Record format of the window rings (None: rows of ``dtype``)."""
        return self.formats.window if self.formats is not None else None

    @property
    def compressed_format(self) -> RecordFormat | None:
        """Record format of the compressed pools (None: rows of ``dtype``)."""
        return self.formats.compressed if self.formats is not None else None

    @property
    def index_key_format(self) -> RecordFormat | None:
        """Record format of the index-key pools (None: rows of ``dtype``)."""
        return self.formats.index_keys if self.formats is not None else None

    def window_ring(self, layer: int) -> Tensor:
        """[num_slots, window, hd] ring of layer ``layer`` (uint8 records [.., record_bytes]
        when ``records``)."""
        try:
            return self.window[layer]
        except KeyError:
            raise ValueError(f"HybridCache: no window ring for layer {layer}; cached layers: "
                             f"{list(self.layers)}") from None

    def _source(self, layer: int) -> int:
        cfg = self.cfg
        if cfg.is_v41 and cfg.ratio(layer) > 0:
            return cfg.kv_source_of(layer)
        return layer

    def compressed_pool(self, layer: int) -> Tensor:
        """[num_pages, page_size // r, hd] compressed entries that layer ``layer`` reads
        (its own, or its KV source's for V4.1 reuse/reindex layers)."""
        src = self._source(layer)
        if src not in self.compressed:
            raise ValueError(f"HybridCache: layer {layer} reads the compressed pool of layer "
                             f"{src}, which has none (layers with pools: "
                             f"{sorted(self.compressed)})")
        return self.compressed[src]

    def index_key_pool(self, layer: int) -> Tensor:
        """[num_pages, page_size // r, dI] indexer keys that layer ``layer`` scores against."""
        src = self._source(layer)
        if src not in self.index_keys:
            raise ValueError(f"HybridCache: layer {layer} reads the index keys of layer {src}, "
                             f"which has none (layers with keys: {sorted(self.index_keys)})")
        return self.index_keys[src]

    def compressor_state(self, layer: int, name: str = "attn") -> CompressorState:
        """Carry-over state of compressor ``name`` ("attn" or "index") of layer ``layer``."""
        try:
            return self.states[(layer, name)]
        except KeyError:
            raise ValueError(f"HybridCache: layer {layer} has no {name!r} compressor state") \
                from None

    # ------------------------------------------------------------------ lifecycle
    def reset_slots(self, slots: Iterable[int] | Tensor) -> None:
        """Clear the carry-over state (and window rows) of slots being (re)used."""
        idx = torch.as_tensor(list(slots) if not isinstance(slots, Tensor) else slots,
                              dtype=torch.int64, device=self.device)
        if idx.numel() == 0:
            return
        if int(idx.min()) < 0 or int(idx.max()) >= self.num_slots:
            raise ValueError(f"HybridCache.reset_slots: slot ids must be in 0..{self.num_slots - 1}"
                             f"; got {idx.tolist()}")
        for ring in self.window.values():
            ring.index_fill_(0, idx, 0.0)
        for state in self.states.values():
            state.reset(idx)
        if self.engram_lookback is not None:
            # No n-gram may reach into the slot's previous sequence.
            self.engram_lookback.index_fill_(0, idx, _ENGRAM_DEAD)

    def check_step(self, seqlens: list[int], start_pos: list[int], slots: list[int],
                   block_tables: list[list[int]]) -> None:
        """Raise a ValueError unless every request's slot and pages cover its tokens."""
        for i, (n, s, slot, bt) in enumerate(zip(seqlens, start_pos, slots, block_tables)):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"request {i}: slot {slot} not in 0..{self.num_slots - 1}")
            if not self.compressed and not self.index_keys:
                continue
            need = (s + n + self.page_size - 1) // self.page_size
            pages = bt[:need]
            if len(pages) < need or any(not 0 <= p < self.num_pages for p in pages):
                raise ValueError(f"request {i}: block table {bt[:need + 1]} does not cover "
                                 f"{s + n} tokens with {need} valid pages of {self.page_size} "
                                 f"(num_pages={self.num_pages})")

    def memory_bytes(self) -> int:
        """Bytes held by every tensor of this cache."""
        ts = list(self.window.values()) + list(self.compressed.values())
        ts += list(self.index_keys.values())
        ts += [t for s in self.states.values() for t in (s.kv, s.score)]
        if self.engram_lookback is not None:
            ts.append(self.engram_lookback)
        return sum(t.numel() * t.element_size() for t in ts)


def _check_page_size(cfg: ModelConfig, page_size: int) -> None:
    if page_size <= 0:
        raise ValueError(f"HybridCache: page_size must be positive; got {page_size}")
    for r in cfg.all_ratios:
        if page_size % r:
            raise ValueError(f"HybridCache: page_size={page_size} must be a multiple of every "
                             f"compression ratio {cfg.all_ratios}")
