"""Piecewise CUDA graphs of eager steps (prefill chunks, mixed prefill + decode steps).

A decode step replays one CUDA graph (``cuda_graphs.DecodeGraphs``); any other step used to
run eagerly, and below ~2K tokens such a step is bound by the host issuing its ~70 launches a
layer, not by the GPU (docs/PERFORMANCE.md, twenty-third session).  Most of those launches do
not touch the caches: they only depend on the step's token count.  So a step of T tokens runs
at the smallest bucket Tb >= T (:data:`PREFILL_BUCKETS`) as L + 1 graph replays with the
cache part of each layer's attention eagerly between them:

* segment 0: the embedding, layer 0's mHC pre and its ``Attention.project`` (q, qr, kv_lat);
* segment i (1..L−1): layer i−1's ``Attention.output`` (inverse RoPE, wo_a, wo_b), its mHC
  post + pre, the MoE, the mHC post fused with layer i's pre, and layer i's ``project``;
* segment L: the last layer's tail;
* between segments i and i+1, eagerly over the T real rows: ``Attention.attend`` (window ring,
  compressor, indexer, sparse attention), whose output is copied into the next segment's input.

The segments read and write persistent buffers of Tb rows (the token ids and positions, the
residual streams, the mHC mixes, q / qr / kv_lat / the attention input, the attention output:
the first rows of buffers of the largest bucket, shared by all), so every replay sees the same
addresses; rows T..Tb−1 are padding (token 0 at position 0, text) whose values flow through the
token-local ops and are never read by the cache part.  The final gather of the wanted rows and
the head's collapse run eagerly.

With graphs off (CPU, or ``use_graphs=False``) the same segments run eagerly over the same
buffers: the CPU tests check that path against ``Transformer.forward``.

V4.1's single-pass blocks split the same way: segment i holds block i−1's tail (``output``,
its mHC post, the FFN mixes, the MoE, their post) and block i's head (its Engram, the attention
mixes, the collapse with the carried pre-mix, attn_norm, ``project``); the Engram row ids
(which advance the slots' lookback) are computed eagerly before segment 0, and the final
collapse after the last.  Under tensor / expert parallelism every rank runs the same plans,
so each captures and replays the same segments in the same order, the all-reduces inside
them (attention output, MoE) included, as the decode graphs do (``graphs_under_tp``); the
runner has the ranks agree on every capture.  The mHC comb lane is off inside these steps
(its Sinkhorn would cross segment boundaries); the side lane of the shared expert stays.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from dsv4.model.attention import PreworkFormats
from dsv4.model.context import StepContext, bucket_for
from dsv4.model.mhc import expand_streams
from dsv4.model.v41 import hc_collapse, hc_final_collapse, hc_mixes, identity_pre_mix
from dsv4.ops.pdl import model_step

log = logging.getLogger("dsv4")

__all__ = ["PrefillGraphs", "PREFILL_BUCKETS", "ENGINE_MAX_TOKENS", "prefill_buckets", "run_step"]

# Token counts of the captured steps (each a set of L + 1 graphs); a step runs at the smallest
# bucket that holds it.  Up to the engine's default step size.
PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048)
# The engine's largest piecewise step.  Below ~1K tokens an eager step waits on the host and
# padding to a bucket is free; above, the step is GPU-bound and padding costs (H100, 4 V4-Flash
# layers: 1,024 tokens 15.7 ms piecewise against 17.7 eager, 2,048 tokens 23.7 against 24.2 —
# so a 1,100-token step padded to 2,048 would be slower than eager).
ENGINE_MAX_TOKENS = 1024


def prefill_buckets(max_tokens: int) -> list[int]:
    """The buckets up to ``max_tokens`` (the largest step a graph serves)."""
    if not isinstance(max_tokens, int) or max_tokens < PREFILL_BUCKETS[0]:
        raise ValueError(f"prefill_buckets: max_tokens must be an integer >= "
                         f"{PREFILL_BUCKETS[0]}; got {max_tokens!r}")
    return [b for b in PREFILL_BUCKETS if b <= max_tokens]


@dataclass
class _Tokens:
    """What the token-local parts read of a step: ids, positions and a memo (RoPE tables)."""

    input_ids: Tensor
    positions: Tensor
    token_types: Tensor      # V4.1 image marks (−1 text; padding rows text)
    memo: dict = field(default_factory=dict)


@dataclass
class _Bucket:
    tokens: _Tokens
    bufs: dict[str, Tensor] = field(default_factory=dict)
    graphs: list[Any] = field(default_factory=list)
    # Layer i's ``Attention.prework`` outputs: their names -> the buffers that hold them.
    prework: dict[int, dict[str, str]] = field(default_factory=dict)


class PrefillGraphs:
    """Piecewise graphs of non-decode steps, one set per token bucket.

    Args:
        model: a V4 or V4.1 ``Transformer`` (this rank's shard under tensor / expert
            parallelism).
        max_tokens: the largest step served (steps of more tokens raise ValueError: callers
            check :meth:`serves` first).
        use_graphs: capture and replay (CUDA only); False runs the segments eagerly.
        cache: the cache the steps will run on.  With it the segments also make the
            token-local inputs of each layer's cache part (``Attention.prework``: the window
            kv and its encoded rows, the compressors' rows, the indexer's queries), which
            depend on its record formats; steps must then run on a cache of the same formats.
    """

    def __init__(self, model: Any, max_tokens: int = 2048, *, use_graphs: bool = True,
                 cache: Any = None) -> None:
        self.v41 = bool(model.cfg.is_v41)
        device = model.embed.weight.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"PrefillGraphs: CUDA graphs need a CUDA device; got {device}")
        self.model = model
        self.device = device
        self.use_graphs = use_graphs
        self.buckets = prefill_buckets(max_tokens)
        self.formats = None if cache is None else PreworkFormats.of(cache)
        self._state: dict[int, _Bucket] = {}
        self._shared: dict[str, Tensor] = {}
        self._pool: Any = None
        self.stats: dict[str, float] = {"steps": 0, "padded_tokens": 0, "capture_s": 0.0,
                                        "graphs": 0}

    # ------------------------------------------------------------------ public
    def serves(self, ctx: StepContext) -> bool:
        """True when this step can run here: at most the largest bucket's tokens and not a
        static-shape decode step."""
        return ctx.static is None and ctx.num_tokens <= self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        """The bucket of a step of ``num_tokens`` tokens (ValueError past the largest)."""
        Tb = bucket_for(num_tokens, self.buckets)
        if Tb is None or num_tokens <= 0:
            raise ValueError(f"PrefillGraphs: a step of {num_tokens} tokens; this serves 1.."
                             f"{self.buckets[-1]}")
        return Tb

    def captured(self, num_tokens: int) -> bool:
        """Whether the bucket of ``num_tokens`` has its graphs."""
        st = self._state.get(self.bucket(num_tokens))
        return st is not None and bool(st.graphs)

    def capture(self, Tb: int) -> None:
        """Capture bucket ``Tb``'s L + 1 segment graphs (each warmed up first)."""
        if not self.use_graphs:
            raise RuntimeError("PrefillGraphs.capture: graphs are off")
        if Tb not in self.buckets:
            raise ValueError(f"PrefillGraphs.capture: {Tb} is not a bucket ({self.buckets})")
        st = self._bucket(Tb)
        if st.graphs:
            return
        t0 = time.perf_counter()
        L = len(self.model.layers)
        torch.cuda.synchronize(self.device)
        with torch.no_grad(), model_step(Tb):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):   # warm-up: compiles, lazy tables, the buffers
                for i in range(L + 1):
                    self._segment(st, i)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graphs = []   # all or none: a capture that fails leaves the bucket without
            for i in range(L + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self._segment(st, i)
                if self._pool is None:
                    self._pool = graph.pool()
                graphs.append(graph)
            st.graphs = graphs
        torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.stats["capture_s"] += dt
        self.stats["graphs"] += L + 1
        log.info("dsv4 engine: captured the %d prefill graphs of %d tokens in %.2f s", L + 1,
                 Tb, dt)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (its pool then serves the smaller ones)."""
        for Tb in sorted(self.buckets, reverse=True):
            self.capture(Tb)

    @torch.no_grad()
    def forward(self, ctx: StepContext, cache: Any) -> Tensor:
        """``Transformer.forward(ctx, cache)`` of a non-decode step: hidden states [N, D] of
        ``ctx.logits_indices``."""
        if not self.serves(ctx):
            raise ValueError(f"PrefillGraphs.forward: a step of {ctx.num_tokens} tokens "
                             f"(static={ctx.static is not None}); this serves non-static steps "
                             f"of at most {self.buckets[-1]}")
        if self.formats is not None and PreworkFormats.of(cache) != self.formats:
            raise ValueError(f"PrefillGraphs.forward: the cache's formats "
                             f"{PreworkFormats.of(cache)} are not the ones the segments were "
                             f"made for ({self.formats})")
        T = ctx.num_tokens
        Tb = self.bucket(T)
        if self.use_graphs and not self.captured(T):
            self.capture(Tb)
        st = self._bucket(Tb)
        ids, pos = st.tokens.input_ids, st.tokens.positions
        ids[:T].copy_(ctx.input_ids)
        pos[:T].copy_(ctx.positions)
        if T < Tb:
            ids[T:].zero_()
            pos[T:].zero_()
        if self.v41:
            types = st.tokens.token_types
            if ctx.token_types is not None:
                types[:T].copy_(ctx.token_types)
                types[T:].fill_(-1)
            else:
                types.fill_(-1)
            # The Engram row ids read (and advance) the slots' lookback state: eagerly, on the
            # step's rows; padding rows look up row 0 (their values are never read).
            token_mask = None if ctx.token_types is None else ctx.token_types < 0
            rows = self.model._engram_rows(ctx, cache, token_mask)
            if rows is not None:
                buf = _engram_rows_buffer(self, st)
                buf[:T].copy_(rows)
                if T < Tb:
                    buf[T:].zero_()
        self.stats["steps"] += 1
        self.stats["padded_tokens"] += Tb - T
        layers = list(self.model.layers)
        with model_step(Tb):
            for i in range(len(layers) + 1):
                if self.use_graphs:
                    st.graphs[i].replay()
                else:
                    self._segment(st, i)
                if i == 0:
                    # The attention's cache part uses the RoPE tables segment 0 made (row-wise
                    # the same values) instead of making them again.
                    for key, (cos, sin) in st.tokens.memo.items():
                        if key[0] == "rope":
                            ctx.memo.setdefault(key, (cos[:T], sin[:T]))
                if i < len(layers):
                    b = st.bufs
                    pre = ({name: b[buf][:T] for name, buf in st.prework[i].items()}
                           if self.formats is not None else None)
                    o = layers[i].attn.attend(b["y"][:T], b["q"][:T], b["qr"][:T],
                                              b["kv_lat"][:T], ctx, cache, pre)
                    b["o"][:T].copy_(o)
            x = st.bufs["x"][:T]
            if self.v41:
                pre_mix = st.bufs["pre_mix"][:T]
                if not ctx.logits_all:
                    x, pre_mix = x[ctx.logits_indices], pre_mix[ctx.logits_indices]
                return self.model.norm(hc_final_collapse(x, pre_mix))
            if not ctx.logits_all:
                x = x[ctx.logits_indices]
            return self.model.hc_head(x, self.model.norm)

    # ------------------------------------------------------------------ segments
    def _bucket(self, Tb: int) -> _Bucket:
        st = self._state.get(Tb)
        if st is None:
            z = torch.zeros(Tb, dtype=torch.int64, device=self.device)
            st = self._state[Tb] = _Bucket(_Tokens(z, z.clone(), torch.full_like(z, -1)))
        return st

    def _buffer(self, st: _Bucket, name: str, like: Tensor) -> Tensor:
        """Bucket ``st``'s persistent buffer ``name`` shaped as ``like`` [Tb, ...]: the first
        Tb rows of one buffer of the largest bucket's rows that every bucket shares (steps run
        one at a time), made on the first, eager run."""
        buf = st.bufs.get(name)
        if buf is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"PrefillGraphs: buffer {name} first seen under capture")
            full = self._shared.get(name)
            if full is None:
                full = self._shared[name] = torch.zeros(
                    (self.buckets[-1], *like.shape[1:]), dtype=like.dtype, device=like.device)
            if full.shape[1:] != like.shape[1:] or full.dtype != like.dtype:
                raise RuntimeError(f"PrefillGraphs: buffer {name} is {full.dtype} "
                                   f"{tuple(full.shape[1:])} per row; a segment made "
                                   f"{like.dtype} {tuple(like.shape[1:])}")
            buf = st.bufs[name] = full[:like.shape[0]]
        return buf

    def _put(self, st: _Bucket, name: str, t: Tensor) -> None:
        """Copy ``t`` into the persistent buffer ``name``."""
        self._buffer(st, name, t).copy_(t)

    def _prework(self, st: _Bucket, i: int, y: Tensor, qr: Tensor, kv_lat: Tensor) -> None:
        """Layer i's ``Attention.prework`` (with a cache's formats) into persistent buffers,
        one per name and row shape (layers of other kinds make other widths)."""
        if self.formats is None:
            return
        attn = self.model.layers[i].attn
        names = st.prework.setdefault(i, {})
        for name, t in attn.prework(y, qr, kv_lat, st.tokens, self.formats).items():
            buf = names.setdefault(name, "pre." + name + "." + "x".join(map(str, t.shape[1:]))
                                   + "." + str(t.dtype))
            self._put(st, buf, t)

    def _segment(self, st: _Bucket, i: int) -> None:
        """Segment i over bucket ``st``'s buffers (module docstring)."""
        if self.v41:
            _segment_v41(self, st, i)
            return
        model, tok, b = self.model, st.tokens, st.bufs
        layers = list(model.layers)
        L = len(layers)
        if i == 0:
            # The RoPE tables of this step's positions: made here (in segment 0's graph), read
            # by the later segments through the memo.
            tok.memo.clear()
            x = expand_streams(model.embed(tok.input_ids), model.cfg.hc_mult)
            pre = layers[0].hc_attn.pre(x, layers[0].attn_norm)
        else:
            blk = layers[i - 1]
            y = blk.attn.output(b["o"], tok, b["y"].dtype)
            x, y, post, comb = blk.hc_attn.post_pre(y, b["x"], b["post"], b["comb"], blk.hc_ffn,
                                                    blk.ffn_norm)
            y = blk.ffn(y, tok.input_ids)
            if i == L:
                self._put(st, "x", blk.hc_ffn.post(y, x, post, comb))
                return
            nxt = layers[i]
            x, *pre = blk.hc_ffn.post_pre(y, x, post, comb, nxt.hc_attn, nxt.attn_norm)
        y, post, comb = pre
        q, qr, kv_lat = layers[i].attn.project(y, tok)
        for name, t in (("x", x), ("post", post), ("comb", comb), ("y", y), ("q", q),
                        ("qr", qr), ("kv_lat", kv_lat)):
            self._put(st, name, t)
        self._prework(st, i, y, qr, kv_lat)
        self._buffer(st, "o", b["q"])   # the attention output (sparse_attn returns q's dtype)


def run_step(model: Any, graphs: PrefillGraphs | None) -> Callable[[StepContext, Any], Tensor]:
    """The forward of non-decode steps: ``graphs.forward`` where it serves, else the model's."""
    def step(ctx: StepContext, cache: Any) -> Tensor:
        if graphs is not None and graphs.serves(ctx):
            return graphs.forward(ctx, cache)
        return model.forward(ctx, cache)
    return step


def _engram_rows_buffer(pg: PrefillGraphs, st: _Bucket) -> Tensor:
    """Bucket ``st``'s Engram row ids [Tb, n_engram_layers, (m−1)·n_heads] int64 (the step
    fills it eagerly; made by the first, eager run of a segment or of a step)."""
    buf = st.bufs.get("engram_rows")
    if buf is not None:
        return buf
    h = pg.model.engram_hasher
    if h is None:
        raise ValueError("PrefillGraphs: the V4.1 model's Engram token map is not set")
    like = torch.zeros((st.tokens.input_ids.shape[0], len(h.layer_ids),
                        h.lookback_len * h.n_heads), dtype=torch.int64, device=pg.device)
    return pg._buffer(st, "engram_rows", like)


def _v41_block_head(pg: PrefillGraphs, st: _Bucket, i: int, x: Tensor, pre_mix: Tensor
                    ) -> None:
    """A V4.1 block up to its attention's ``project`` (spec §4.6): its Engram, the attention
    mixes, the collapse with the carried pre-mix, attn_norm; the results into the buffers."""
    cfg, tok = pg.model.cfg, st.tokens
    blk = pg.model.layers[i]
    if blk.engram is not None:
        rows = _engram_rows_buffer(pg, st)
        x = blk.engram(x, rows[:, blk.engram.index], tok.token_types < 0)
    hc = blk.hc_attn
    a_pre, a_post, a_comb = hc_mixes(x, hc.fn, hc.scale, hc.base, cfg.norm_eps, cfg.hc_eps,
                                     cfg.hc_sinkhorn_iters)
    y = blk.attn_norm(hc_collapse(x, pre_mix))
    q, qr, kv_lat = blk.attn.project(y, tok)
    for name, t in (("x", x), ("a_pre", a_pre), ("a_post", a_post), ("a_comb", a_comb),
                    ("y", y), ("q", q), ("qr", qr), ("kv_lat", kv_lat)):
        pg._put(st, name, t)
    pg._prework(st, i, y, qr, kv_lat)
    pg._buffer(st, "o", st.bufs["q"])


def _v41_block_tail(pg: PrefillGraphs, st: _Bucket, blk: Any) -> tuple[Tensor, Tensor]:
    """A V4.1 block after its attention's cache part: ``output``, the post, the FFN mixes, the
    MoE and its post; returns (x, the pre-mix for the next block)."""
    cfg, tok, b = pg.model.cfg, st.tokens, st.bufs
    out = blk.attn.output(b["o"], tok, b["y"].dtype)
    x = blk.ops.hc_post(out, b["x"], b["a_post"], b["a_comb"])
    hc = blk.hc_ffn
    f_pre, f_post, f_comb = hc_mixes(x, hc.fn, hc.scale, hc.base, cfg.norm_eps, cfg.hc_eps,
                                     cfg.hc_sinkhorn_iters)
    y = blk.ffn(blk.ffn_norm(hc_collapse(x, b["a_pre"])), tok.input_ids, tok.token_types >= 0)
    return blk.ops.hc_post(y, x, f_post, f_comb), f_pre


def _segment_v41(pg: PrefillGraphs, st: _Bucket, i: int) -> None:
    """Segment i of a V4.1 model: block i−1's tail, then block i's head (module docstring)."""
    model, tok = pg.model, st.tokens
    layers = list(model.layers)
    if i == 0:
        tok.memo.clear()   # the RoPE tables of this step, as in V4's segment 0
        x = expand_streams(model.embed(tok.input_ids), model.cfg.hc_mult)
        pre_mix = identity_pre_mix(model.cfg.hc_mult, x.shape[0], device=x.device)
    else:
        x, pre_mix = _v41_block_tail(pg, st, layers[i - 1])
    if i == len(layers):
        pg._put(st, "x", x)
        pg._put(st, "pre_mix", pre_mix)
        return
    _v41_block_head(pg, st, i, x, pre_mix)
