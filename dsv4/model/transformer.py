"""The model body: V4 (spec §3.3–3.11: embedding, mHC blocks, ``hc_head``, head) and V4.1
(spec §4: Engram before its blocks, single-pass mHC, final collapse without ``hc_head``, DSpark
stages loaded but not run); and ``load_model``.

Module paths spell the official tensor names (``embed``, ``layers.{L}.attn.*``,
``layers.{L}.ffn.*``, ``norm``, ``head``, ``mtp.0.*``), so loading is a name-for-name
assignment. Two groups of tensors are held differently from their spelling and are mapped by
the modules themselves: the mHC triples (``hc_attn_fn`` -> ``hc_attn.fn``, see ``mhc.py``) and
the routed experts (``experts.{e}.w1.weight`` -> row e of the stacked ``experts.w1``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import ModelConfig
from dsv4.dist.parallel import SINGLE, Parallel
from dsv4.model.layers import (Linear, RMSNorm, check_numerics, keeps_quantized,
                               load_device, quantized_storage, set_parameter)
from dsv4.model.mhc import HyperConnection, HyperHead, expand_streams
from dsv4.model.moe import Gate, MoE
from dsv4.model.v41 import hc_final_collapse, identity_pre_mix, single_pass_block
from dsv4.ops import get_ops
from dsv4.ops.pdl import model_step
from dsv4.ops.streams import deferred_comb

log = logging.getLogger("dsv4")

DEFAULT_PAGE_SIZE = 256


class Embedding(nn.Module):
    """``embed.weight`` [vocab, D]: token ids -> [T, D]."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, dim, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


# Vocabulary rows per fp32 chunk of the exact bf16-head fallback (bounds its temporary to
# ~256 MiB at D = 7168).
_HEAD_CHUNK_BYTES = 1 << 28


class Head(nn.Module):
    """``head.weight`` [vocab, D] -> logits [N, vocab] in fp32 (the reference computes logits
    in fp32).

    Held in fp32 on the dense (CPU) storage, and whenever the compute dtype is fp32: then
    ``F.linear`` in fp32, as before.  With quantized (GPU) storage and a bf16 / fp16 compute
    dtype it keeps the checkpoint's bf16: the fp32 copy would read 2x the bytes every decode
    step (2.1 GB on V4-Flash) for the same values, since bf16 weights and hidden states are
    exact in fp32.  Logits then come from ``torch.mm(..., out_dtype=torch.float32)`` on CUDA
    (bf16 products, fp32 accumulation and output), elsewhere from fp32 products of row chunks.
    """

    def __init__(self, vocab_size: int, dim: int, compute_dtype: torch.dtype = torch.float32,
                 keep_quantized: bool | None = None) -> None:
        super().__init__()
        narrow = compute_dtype in (torch.bfloat16, torch.float16)
        wdtype = torch.bfloat16 if narrow and keeps_quantized(keep_quantized) else torch.float32
        self.weight = nn.Parameter(torch.zeros(vocab_size, dim, dtype=wdtype),
                                   requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits [..., vocab] float32."""
        w = self.weight
        if w.dtype == torch.float32:
            return F.linear(hidden.float(), w)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.is_cuda and flat.dtype == w.dtype:
            out = torch.mm(flat, w.t(), out_dtype=torch.float32)
        else:
            # Exact elsewhere (CPU, or fp32 hidden states): fp32 products of bf16 rows, a chunk
            # of the vocabulary at a time so no fp32 copy of the whole head exists.
            x = flat.float()
            rows = max(1, _HEAD_CHUNK_BYTES // (4 * w.shape[1]))
            out = torch.cat([F.linear(x, w[i:i + rows].float())
                             for i in range(0, w.shape[0], rows)], dim=-1)
        return out.reshape(*hidden.shape[:-1], w.shape[0])


class _Sublayers(nn.Module):
    """The modules of every block: norm + mHC around the attention and around the MoE
    (``moe_cfg``, when given, shapes the MoE instead of ``cfg``)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: Any,
                 dtype: torch.dtype, moe_cfg: ModelConfig | None,
                 parallel: Parallel | None) -> None:
        super().__init__()
        from dsv4.model.attention import Attention  # owned by the attention engineer

        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.hc_attn = HyperConnection(cfg, ops)
        self.hc_ffn = HyperConnection(cfg, ops)
        self.attn = Attention(cfg, layer_id, numerics, ops, dtype, parallel=parallel)
        self.ffn = MoE(moe_cfg or cfg, layer_id, numerics, ops, dtype, parallel=parallel)


HcPre = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (y [T, D], post [T, n], comb [T, n, n])


class Block(_Sublayers):
    """One V4 block (spec §3.5): mHC around attention, then mHC around the MoE.

    ``forward(x [T, n_hc, D], ctx, cache) -> [T, n_hc, D]``.  Chained (what ``Transformer``
    does): ``forward(x, ctx, cache, attn_pre, next_hc, next_norm) -> (x, next_pre)`` where
    ``attn_pre`` is ``hc_attn.pre(x, attn_norm)`` already computed (fused into the previous
    block's last post; its y is normed by this block's ``attn_norm``) and
    ``next_pre = next_hc.pre(x_out, next_norm)`` (``next_norm``: the next block's
    ``attn_norm``) comes out of this block's last post (``hc_post_pre``).  Each post inside a
    block is fused with the following pre the same way; the input norms run inside the hc ops.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: Any,
                 dtype: torch.dtype, parallel: Parallel | None = None) -> None:
        super().__init__(cfg, layer_id, numerics, ops, dtype, None, parallel)

    def forward(self, x: torch.Tensor, ctx: Any, cache: Any, attn_pre: HcPre | None = None,
                next_hc: HyperConnection | None = None, next_norm: RMSNorm | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, HcPre]:
        if next_hc is not None and next_norm is None:
            raise ValueError("Block.forward: next_hc needs next_norm (the next block's "
                             "attn_norm: its pre comes out normed)")
        # The sublayer input norms (attn_norm / ffn_norm) run inside the hc ops: y comes normed.
        # Large prefill steps: the experts' weight prework (FP8 re-encoding) beside the attention.
        self.ffn.encode_ahead(x.shape[0])
        y, post, comb = self.hc_attn.pre(x, self.attn_norm) if attn_pre is None else attn_pre
        y = self.attn(y, ctx, cache)
        x, y, post, comb = self.hc_attn.post_pre(y, x, post, comb, self.hc_ffn, self.ffn_norm)
        y = self.ffn(y, ctx.input_ids)
        if next_hc is None:
            return self.hc_ffn.post(y, x, post, comb)
        x, *next_pre = self.hc_ffn.post_pre(y, x, post, comb, next_hc, next_norm)
        return x, (next_pre[0], next_pre[1], next_pre[2])


class MTPBlock(Block):
    """V4 multi-token-prediction stage ``mtp.{k}`` (spec §3.11): a ratio-0 block plus
    ``e_proj``/``h_proj``/``enorm``/``hnorm``/``norm`` and its own ``hc_head``.
    Loaded and validated; not run yet (speculative decoding comes later)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: Any,
                 dtype: torch.dtype, parallel: Parallel | None = None) -> None:
        super().__init__(cfg, layer_id, numerics, ops, dtype, parallel)
        fmt = "fp8" if cfg.quantized else "bf16"
        b, d = cfg.weight_block_size, cfg.dim
        self.e_proj = Linear(d, d, fmt=fmt, block=b, numerics=numerics, dtype=dtype)
        self.h_proj = Linear(d, d, fmt=fmt, block=b, numerics=numerics, dtype=dtype)
        self.enorm = RMSNorm(d, cfg.norm_eps, ops)
        self.hnorm = RMSNorm(d, cfg.norm_eps, ops)
        self.norm = RMSNorm(d, cfg.norm_eps, ops)
        self.hc_head = HyperHead(cfg, ops)

    def forward(self, x: torch.Tensor, ctx: Any, cache: Any) -> torch.Tensor:
        raise NotImplementedError("MTP stages are loaded but not run by this version of dsv4")


class BlockV41(_Sublayers):
    """One V4.1 block (spec §4.6, §4.7): the optional Engram on the streams, then the single-pass
    mHC block whose attention collapses with the previous sublayer's pre-mix.

    ``forward(x [T, n_hc, D], pre_mix [T, n_hc], ctx, cache, engram_rows, token_mask)
    -> (x, pre_mix for the next block)``.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: Any,
                 dtype: torch.dtype, moe_cfg: ModelConfig | None = None,
                 parallel: Parallel | None = None) -> None:
        super().__init__(cfg, layer_id, numerics, ops, dtype, moe_cfg, parallel)
        from dsv4.model.engram import Engram

        self.cfg = cfg
        self.ops = ops
        self.engram: Engram | None = None
        if layer_id < cfg.n_layers and layer_id in cfg.engram_layer_ids:
            self.engram = Engram(cfg, layer_id, numerics, ops, dtype, parallel=parallel)

    def forward(self, x: torch.Tensor, pre_mix: torch.Tensor, ctx: Any, cache: Any,
                engram_rows: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``engram_rows`` [T, n_engram_layers, cols] (all Engram layers' row ids of the step),
        ``token_mask`` [T] bool (False on image tokens) or None (all text)."""
        self.ffn.encode_ahead(x.shape[0])   # as Block.forward
        if self.engram is not None:
            if engram_rows is None:
                raise ValueError(f"BlockV41(layer {self.layer_id}): an Engram layer needs the "
                                 f"step's Engram row ids")
            x = self.engram(x, engram_rows[:, self.engram.index], token_mask)
        image_mask = None if token_mask is None else ~token_mask

        def attn(y: torch.Tensor) -> torch.Tensor:
            return self.attn(self.attn_norm(y), ctx, cache)

        def ffn(y: torch.Tensor) -> torch.Tensor:
            return self.ffn(self.ffn_norm(y), ctx.input_ids, image_mask)

        cfg = self.cfg
        return single_pass_block(x, pre_mix, self.hc_attn, self.hc_ffn, attn, ffn, cfg.norm_eps,
                                 cfg.hc_eps, cfg.hc_sinkhorn_iters, hc_post=self.ops.hc_post)


class DSparkStage(BlockV41):
    """V4.1 DSpark drafter stage ``mtp.{k}`` (spec §4.10): a ratio-0 block whose MoE has
    ``dspark_n_routed_experts`` experts (top ``dspark_n_activated_experts``); stage 0 adds
    ``main_proj`` / ``main_norm``, the last stage ``norm``, ``markov_head`` and
    ``confidence_head``.  Loaded and validated; not run yet (speculative decoding comes later).
    """

    def __init__(self, cfg: ModelConfig, stage: int, numerics: str, ops: Any,
                 dtype: torch.dtype, parallel: Parallel | None = None) -> None:
        moe_cfg = cfg.replace(
            n_routed_experts=cfg.dspark_n_routed_experts or cfg.n_routed_experts,
            n_activated_experts=cfg.dspark_n_activated_experts or cfg.n_activated_experts)
        super().__init__(cfg, cfg.n_layers + stage, numerics, ops, dtype, moe_cfg=moe_cfg,
                         parallel=parallel)
        self.stage = stage
        fmt = "fp8" if cfg.quantized else "bf16"
        d = cfg.dim
        if stage == 0:
            self.main_proj = Linear(d * len(cfg.dspark_target_layer_ids), d, fmt=fmt,
                                    block=cfg.weight_block_size, numerics=numerics, dtype=dtype)
            self.main_norm = RMSNorm(d, cfg.norm_eps, ops)
        if stage == cfg.n_mtp_layers - 1:
            rank = cfg.dspark_markov_rank
            self.norm = RMSNorm(d, cfg.norm_eps, ops)
            self.markov_head = nn.Module()
            self.markov_head.embed = Embedding(cfg.vocab_size, rank, dtype)
            self.markov_head.head = Linear(rank, cfg.vocab_size, fmt="bf16", numerics=numerics,
                                           dtype=dtype)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = Linear(d + rank, 1, fmt="bf16", numerics=numerics,
                                               dtype=dtype)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("DSpark stages are loaded but not run by this version of dsv4")


class Transformer(nn.Module):
    """DeepSeek-V4 (Flash / Flash-Base / Pro) and V4.1-Flash text model.

    ``forward(ctx, cache) -> hidden [N, D]`` for the rows ``ctx.logits_indices`` (after the final
    stream collapse and norm); ``compute_logits(hidden) -> [N, vocab]`` fp32;
    ``forward_full(input_ids) -> [S, vocab]`` runs one sequence with a fresh cache.

    V4.1 with Engram layers needs the tokenizer's compressed token map before the first forward
    (``set_engram_token_map``; ``load_model`` does it from the checkpoint's tokenizer).
    """

    def __init__(self, cfg: ModelConfig, numerics: str = "bf16", backend: str = "torch",
                 dtype: torch.dtype = torch.bfloat16, parallel: Parallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # Tensor / expert parallel rank (dsv4.dist); embedding, mHC and head are replicated.
        self.parallel = par = parallel or SINGLE
        self.numerics = check_numerics(numerics)
        self.backend = backend
        self.dtype = dtype
        self.ops = get_ops(backend)
        self.embed = Embedding(cfg.vocab_size, cfg.dim, dtype)
        self.engram_hasher: Any = None  # V4.1: set by set_engram_token_map
        if cfg.is_v41:
            # No hc_head in V4.1: the last pre-mix collapses the streams (spec §4.6).
            self.layers = nn.ModuleList(
                [BlockV41(cfg, i, numerics, self.ops, dtype, parallel=par)
                 for i in range(cfg.n_layers)])
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.ops)
            self.head = Head(cfg.vocab_size, cfg.dim, dtype)
            self.mtp = nn.ModuleList([DSparkStage(cfg, k, numerics, self.ops, dtype, par)
                                      for k in range(cfg.n_mtp_layers)])
            return
        self.layers = nn.ModuleList(
            [Block(cfg, i, numerics, self.ops, dtype, par) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.ops)
        self.head = Head(cfg.vocab_size, cfg.dim, dtype)
        self.hc_head = HyperHead(cfg, self.ops)
        self.mtp = nn.ModuleList([MTPBlock(cfg, cfg.n_layers + k, numerics, self.ops, dtype, par)
                                  for k in range(cfg.n_mtp_layers)])

    # ------------------------------------------------------------------------ V4.1 Engram
    def set_engram_token_map(self, token_map: Sequence[int] | torch.Tensor,
                             compressed_vocab_size: int | None = None) -> None:
        """Install the Engram hash state machine from the tokenizer's compressed token map
        (``dsv4.model.engram.build_compressed_token_map``).  ``compressed_vocab_size`` must equal
        the config's ``engram_compressed_vocab_size`` (ValueError with both numbers)."""
        from dsv4.model.engram import NgramHasher

        if not self.cfg.is_v41 or not self.cfg.engram_layer_ids:
            raise ValueError("set_engram_token_map: this model has no Engram layers")
        self.engram_hasher = NgramHasher.from_config(self.cfg, token_map, compressed_vocab_size,
                                                     device=self.embed.weight.device)

    def _engram_rows(self, ctx: Any, cache: Any, token_mask: torch.Tensor | None
                     ) -> torch.Tensor | None:
        """Row ids [T, n_engram_layers, cols] of the step; advances the slots' lookback."""
        from dsv4.model.engram import DEAD

        if not self.cfg.engram_layer_ids:
            return None
        if self.engram_hasher is None:
            raise ValueError("V4.1 forward: the Engram token map is not set; load the model with "
                             "load_model(path) or call model.set_engram_token_map(...)")
        state = cache.engram_lookback
        if state is None:
            raise ValueError("V4.1 forward: the cache has no Engram lookback state (allocate it "
                             "with this model's config)")
        lookback = state[ctx.slots]
        # A request at position 0 has nothing before it, whatever its slot held.
        lookback = torch.where((ctx.start_pos == 0)[:, None], torch.full_like(lookback, DEAD),
                               lookback)
        rows, new_lookback = self.engram_hasher(ctx.input_ids, ctx.cu_seqlens, lookback,
                                                token_mask)
        state.index_copy_(0, ctx.slots, new_lookback.to(state.dtype))
        return rows

    @torch.no_grad()
    def prepare_decode_weights(self) -> int:
        """Make every decode-only weight form now (the attention's FP8 wo_a copies on the GPU),
        before the engine sizes its cache; returns the bytes they take (0 on CPUs)."""
        return sum(m.prepare_decode_weights() for m in self.modules()
                   if m is not self and hasattr(m, "prepare_decode_weights"))

    def keep_expert_fp8_codes(self) -> int:
        """Keep every MXFP4 expert stack's FP8 re-encoding on the GPU (``Experts.keep_fp8_codes``:
        the prefill's FP8-MMA expert GEMMs then skip their per-call re-encoding); returns the
        bytes kept (0 on CPUs and for other expert formats)."""
        return sum(m.keep_fp8_codes() for m in self.modules() if hasattr(m, "keep_fp8_codes"))

    # ------------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ctx: Any, cache: Any) -> torch.Tensor:
        """Run the step ``ctx`` against ``cache``; hidden states [N, D] of ctx.logits_indices."""
        # Programmatic dependent launch for small steps only (dsv4/ops/pdl.py says why).
        tokens = int(ctx.input_ids.shape[0])
        with model_step(tokens, self.parallel.enabled):
            if self.cfg.is_v41:
                return self._forward_v41(ctx, cache)
            # The mHC Sinkhorn of each sublayer on its own stream (dsv4/ops/streams.py).
            with deferred_comb(ctx.input_ids.device, tokens):
                return self._forward_v4(ctx, cache)

    def _forward_v4(self, ctx: Any, cache: Any) -> torch.Tensor:
        x = expand_streams(self.embed(ctx.input_ids), self.cfg.hc_mult)
        layers = list(self.layers)
        # Each block's last hc_post computes the next block's attention pre in the same pass.
        pre = layers[0].hc_attn.pre(x, layers[0].attn_norm) if layers else None
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                nxt = layers[i + 1]
                x, pre = layer(x, ctx, cache, pre, nxt.hc_attn, nxt.attn_norm)
            else:
                x = layer(x, ctx, cache, pre)
        if not ctx.logits_all:
            x = x[ctx.logits_indices]
        # The final norm runs inside the collapse (one launch at decode).
        return self.hc_head(x, self.norm)

    def _forward_v41(self, ctx: Any, cache: Any) -> torch.Tensor:
        """V4.1 step (docs/V41.md "One step"): Engram rows once, blocks with the pre-mix carried
        from block to block, the final collapse with the last pre-mix, norm."""
        # Image-span tokens (token_types >= 0) are DEAD for Engram and route with bias_vl.
        token_mask = None if ctx.token_types is None else ctx.token_types < 0
        engram_rows = self._engram_rows(ctx, cache, token_mask)
        x = expand_streams(self.embed(ctx.input_ids), self.cfg.hc_mult)
        pre_mix = identity_pre_mix(self.cfg.hc_mult, x.shape[0], device=x.device)
        for layer in self.layers:
            x, pre_mix = layer(x, pre_mix, ctx, cache, engram_rows, token_mask)
        if not ctx.logits_all:
            rows = ctx.logits_indices
            x, pre_mix = x[rows], pre_mix[rows]
        return self.norm(hc_final_collapse(x, pre_mix))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, vocab] in fp32 (fp32 accumulation; see ``Head``)."""
        return self.head(hidden)

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor | Sequence[int],
                     token_types: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Un-batched forward of one whole sequence from position 0: logits [S, vocab] fp32."""
        from dsv4.cache.tensors import HybridCache
        from dsv4.model.context import StepContext, pages_needed

        device = self.embed.weight.device
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"forward_full: input_ids must be a non-empty 1-D sequence; found "
                             f"shape {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"forward_full: token ids must be in 0..{self.cfg.vocab_size - 1}; "
                             f"found the range {lo}..{hi}")
        if token_types is not None:
            if not self.cfg.is_v41:
                raise ValueError("forward_full: token_types (image marks) are a V4.1 input; "
                                 "V4 models take None")
            token_types = torch.as_tensor(token_types, dtype=torch.int64, device=device)
            if tuple(token_types.shape) != tuple(ids.shape):
                raise ValueError(f"forward_full: token_types has shape "
                                 f"{tuple(token_types.shape)}; expected {tuple(ids.shape)} "
                                 f"(one mark per token)")
        ctx = StepContext.single(ids, start_pos=0, page_size=DEFAULT_PAGE_SIZE,
                                 token_types=token_types, all_logits=True)
        cache = HybridCache.allocate(self.cfg, num_pages=pages_needed(ids.numel(),
                                                                      DEFAULT_PAGE_SIZE),
                                     num_slots=1, page_size=DEFAULT_PAGE_SIZE, dtype=self.dtype,
                                     device=device)
        return self.compute_logits(self.forward(ctx, cache))

    # ------------------------------------------------------------------------ loading
    def load_targets(self) -> dict[str, Callable[[Any], None]]:
        """Every official tensor name this model expects -> a function that loads it."""
        out: dict[str, Callable[[Any], None]] = {}
        _collect_targets(self, "", out)
        return out

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, Any], consume: bool = False) -> None:
        """Assign checkpoint tensors by official name; every expected name must be present and
        no other name may be (ValueError listing them). ``consume`` pops entries as they load
        (keeps peak memory at one copy)."""
        names = list(tensors)
        self.load_stream(names, ((n, tensors.pop(n) if consume else tensors[n]) for n in names))

    @torch.no_grad()
    def load_stream(self, names: Sequence[str], items: Iterable[tuple[str, Any]]) -> None:
        """Load ``(official name, value)`` pairs as they arrive (a
        ``dsv4.checkpoint.CheckpointReader``), each put in place before the next is read.

        ``names`` (all the names ``items`` will give) must equal the model's expected names
        (ValueError listing the missing and unexpected ones, before anything is loaded).  A
        model built on ``meta`` (:func:`build_model`) takes each value's device and adopts
        values already in the held dtype; afterwards no parameter may be left on ``meta``."""
        targets = self.load_targets()
        given = set(names)
        missing = sorted(n for n in targets if n not in given)
        unexpected = sorted(n for n in names if n not in targets)
        if missing or unexpected:
            raise ValueError("checkpoint does not match the model: "
                             f"{len(missing)} missing ({_preview(missing)}), "
                             f"{len(unexpected)} unexpected ({_preview(unexpected)})")
        loaded: set[str] = set()
        for name, value in items:
            load = targets.get(name)
            if load is None or name in loaded:
                what = "loaded twice" if load else "not a tensor of this model"
                raise ValueError(f"{name}: {what} (the stream disagrees with its own names)")
            try:
                load(value)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            del value  # the model holds what it keeps; nothing else outlives this step
            loaded.add(name)
        if len(loaded) != len(targets):
            left = sorted(set(targets) - loaded)
            raise ValueError(f"checkpoint stream ended early: {len(left)} tensor(s) not loaded "
                             f"({_preview(left)})")
        unset = [n for n, t in list(self.named_parameters()) + list(self.named_buffers())
                 if t.is_meta]
        if unset:
            raise ValueError(f"{len(unset)} model tensor(s) have no storage after loading (still "
                             f"on the meta device): {_preview(unset)}")
        for module in self.modules():
            if isinstance(module, Gate):
                module.check_tid2eid()
        if self.cfg.n_mtp_layers and self.cfg.is_v41:
            log.info("dsv4: %d DSpark stage(s) loaded and validated; not run (no speculative "
                     "decoding yet)", self.cfg.n_mtp_layers)
        elif self.cfg.n_mtp_layers:
            log.info("dsv4: %d MTP stage(s) loaded and validated; not run (no speculative "
                     "decoding yet)", self.cfg.n_mtp_layers)


def _preview(names: list[str], k: int = 8) -> str:
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "") if names else "none"


def _param_setter(module: nn.Module, attr: str) -> Callable[[Any], None]:
    """A loader for the plain parameter/buffer ``module.attr``: same shape, cast to its dtype.
    A ``meta`` placeholder adopts the value (on the value's device); real storage is copied
    into."""
    def load(value: Any) -> None:
        current: torch.Tensor = getattr(module, attr)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"expected a dense tensor; got {type(value).__name__}")
        if tuple(value.shape) != tuple(current.shape):
            raise ValueError(f"expected shape {tuple(current.shape)}; found {tuple(value.shape)}")
        if value.is_floating_point() != current.is_floating_point():
            raise ValueError(f"expected a {current.dtype} tensor; found {value.dtype}")
        value = value.to(device=load_device(current, value.device), dtype=current.dtype)
        if current.is_meta:
            set_parameter(module, attr, value)
        else:
            current.copy_(value)
    return load


def _collect_targets(module: nn.Module, prefix: str, out: dict[str, Callable[[Any], None]]
                     ) -> None:
    # A Linear loads its (possibly quantized) weight itself; modules whose storage differs from
    # the official spelling describe their names (mHC triples) or loaders (stacked experts).
    if isinstance(module, Linear):
        out[f"{prefix}weight"] = module.load_weight
        return
    if hasattr(module, "official_targets"):
        out.update(module.official_targets(prefix))
        return
    if hasattr(module, "official_names"):
        for official, attr in module.official_names(prefix).items():
            out[official] = _param_setter(module, attr)
        return
    for name, _ in module.named_parameters(recurse=False):
        out[prefix + name] = _param_setter(module, name)
    for name, _ in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            out[prefix + name] = _param_setter(module, name)
    for name, child in module.named_children():
        _collect_targets(child, f"{prefix}{name}.", out)


def build_model(cfg: ModelConfig, numerics: str = "bf16", backend: str = "torch",
                dtype: torch.dtype = torch.bfloat16, parallel: Parallel | None = None,
                keep_quantized: bool = False) -> Transformer:
    """The model of ``cfg`` with no storage: every parameter is a ``meta`` placeholder (shape and
    dtype only) until :meth:`Transformer.load_stream` / ``load_tensors`` gives it the loaded
    tensor, on that tensor's device.  Nothing the checkpoint replaces is ever allocated (a V4.1
    Engram table is ~98 GB, the routed experts of a layer ~3 GB).  ``keep_quantized``: the
    storage of a GPU model (FP8 / MXFP4 weights as loaded, bf16 head; ``quantized_storage``)."""
    with torch.device("meta"), quantized_storage(keep_quantized):
        return Transformer(cfg, numerics=numerics, backend=backend, dtype=dtype,
                           parallel=parallel)


def load_model(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               numerics: str = "bf16", backend: str = "torch",
               parallel: Parallel | None = None) -> Transformer:
    """Build the model of the checkpoint at ``path`` and load every tensor.

    ``dtype`` defaults to float32 on CPU and bfloat16 elsewhere. Raises ValueError on a
    missing, unexpected or mis-shaped tensor.  V4.1 with Engram layers: the compressed token map
    is built from the checkpoint's tokenizer; its size must equal
    ``engram_compressed_vocab_size`` (ValueError with both numbers).  ``parallel`` (a rank of
    a tensor / expert parallel launch, ``dsv4.dist``): the model holds and reads from the files
    only this rank's shard (``dsv4.dist.sharding``).

    Memory: the model is built without storage (:func:`build_model`) and the checkpoint is
    streamed (``dsv4.checkpoint.open_checkpoint``): each tensor is read from the memory-mapped
    file on the host, moved to ``device`` and put in place (adopted, or copied into the routed
    expert stack) before the next is read, so the device peaks at the model plus one tensor.
    """
    from dsv4.checkpoint import open_checkpoint  # owned by the checkpoint engineer
    from dsv4.dist.sharding import shard_plan

    cfg = ModelConfig.from_file(path)
    dev = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    check_numerics(numerics)
    par = parallel or SINGLE
    # GPU kernels read the quantized weights; the torch path works on dense ones.
    keep_quantized = dev.type == "cuda"
    model = build_model(cfg, numerics=numerics, backend=backend, dtype=dtype, parallel=par,
                        keep_quantized=keep_quantized)
    reader = open_checkpoint(path, cfg, device=dev, dtype=dtype, keep_quantized=keep_quantized,
                             shard_plan=shard_plan(cfg, par))
    model.load_stream(reader.names, reader)
    if cfg.is_v41 and cfg.engram_layer_ids:
        from dsv4.model.engram import build_compressed_token_map
        from dsv4.tokenizer import load_tokenizer

        ckpt_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        token_map, n_compressed = build_compressed_token_map(load_tokenizer(ckpt_dir))
        model.set_engram_token_map(token_map, n_compressed)
    return model.eval()
