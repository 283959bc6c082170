"""Mixture of experts of a V4 block (spec §3.9): gate, routed experts, one shared expert.

Routing: ``s = sqrt(softplus(x·W_gateᵀ))`` in fp32; learned layers pick the top-k of ``s + bias``
(the bias only steers the selection), hash layers (``layer_id < n_hash_layers``) take the picks
from ``tid2eid[input_id]``; the weights are the unbiased ``s`` of the picks, normalized to sum 1,
times ``route_scale``. Experts are SwiGLU with the ``swiglu_limit`` clamp; the routing weight
multiplies the activation before ``w2``. Routed outputs are summed in fp32 with the shared expert.

The routed experts are held stacked (``w1``/``w3`` [E, I, D], ``w2`` [E, D, I]) so the expert op,
and later a grouped GEMM, see whole [E, ...] tensors; the official per-expert tensors
``experts.{e}.w1.weight`` are written into row e at load time.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

from dsv4.config import ModelConfig
from dsv4.dist.parallel import SINGLE, Parallel
from dsv4.dist.sharding import splits_shared_expert
from dsv4.formats import FP4_BLOCK
from dsv4.model.layers import (Linear, check_numerics, fp32_math_dtype, fused_linears,
                               keeps_quantized, set_parameter)
from dsv4.ops import get_ops
from dsv4.ops.streams import join_side_lane, side_lane
from dsv4.ops.torch_dense import ExpertWeights, expert_k_step, kchunk_experts, rows_kchunk

_EXPERT_NAME = re.compile(r"^(\d+)\.(w1|w2|w3)\.weight$")


def _dense(value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint value (Tensor or QuantWeight) as a dense tensor of ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    if hasattr(value, "dequantize"):
        return value.dequantize(dtype)
    raise ValueError(f"expected a Tensor or QuantWeight; got {type(value).__name__}")


class Gate(nn.Module):
    """Router of one MoE layer: ``weight`` [E, D] (fp32 math), ``bias`` [E] on learned layers
    or ``tid2eid`` [vocab, k] on hash layers.  V4.1 (spec §4.8) adds ``bias_vl`` [E], the
    selection bias of image tokens, ``gate_temp`` and the ``+1e-20`` normalization.

    ``ops``: the op table whose ``moe_route`` routes the V4 gate logits (default: the torch
    twins)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ops: SimpleNamespace | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.ops = ops if ops is not None else get_ops("torch")
        self.top_k = cfg.n_activated_experts
        self.num_experts = cfg.n_routed_experts
        self.route_scale = cfg.route_scale
        self.is_hash = cfg.is_hash_layer(layer_id)
        self.is_v41 = cfg.is_v41
        self.gate_temp = cfg.gate_temp
        self.norm_topk_prob = cfg.norm_topk_prob
        # Stored bf16 in the checkpoint; the reference computes the gate in fp32: held in fp32,
        # or in its exact bf16 on the GPU with a bf16 compute ``dtype`` (fp32_math_dtype).
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.dim,
                                               dtype=fp32_math_dtype(dtype)),
                                   requires_grad=False)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k,
                                                        dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                     requires_grad=False)
        if self.is_v41:
            self.bias_vl = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                        requires_grad=False)

    def check_tid2eid(self) -> None:
        """Raise if a loaded hash table points outside 0..E-1 (it would index garbage)."""
        if self.is_hash and self.tid2eid.numel():
            lo, hi = int(self.tid2eid.min()), int(self.tid2eid.max())
            if lo < 0 or hi >= self.num_experts:
                raise ValueError(f"ffn.gate.tid2eid: expert ids must be in 0..{self.num_experts - 1}"
                                 f"; found the range {lo}..{hi}")

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor,
                image_mask: torch.Tensor | None = None, experts: ExpertWeights | None = None
                ) -> tuple[torch.Tensor, ...]:
        """x [T, D], input_ids [T] -> (weights [T, k] fp32, expert ids [T, k] int64).

        ``image_mask`` [T] bool (V4.1): tokens of image spans select with ``bias_vl``.
        ``experts`` (V4, one rank: the stacks the ids index, x their input): a third value, the
        routed experts' decode plan of the ids (``ops.moe_gate_plan``: built in the routing
        launch at decode, so the experts skip their plan launch; None where the op is missing
        or does not apply).
        """
        if self.is_v41:
            from dsv4.model.v41 import route_v41
            ids, weights = route_v41(x, self.weight, self.bias, self.bias_vl, image_mask,
                                     self.top_k, self.route_scale, self.gate_temp,
                                     self.norm_topk_prob, ops=self.ops)
            return (weights, ids) if experts is None else (weights, ids, None)
        bias, tid2eid, ids = ((None, self.tid2eid, input_ids) if self.is_hash
                              else (self.bias, None, None))
        with_plan = getattr(self.ops, "moe_gate_plan", None)
        if experts is not None and with_plan is not None:
            return with_plan(x, self.weight, bias, tid2eid, ids, self.top_k, self.route_scale,
                             experts)
        gate = getattr(self.ops, "moe_gate", None)
        if gate is not None:
            # The gate GEMM and the routing as one op (at decode one kernel).
            out = gate(x, self.weight, bias, tid2eid, ids, self.top_k, self.route_scale)
        else:
            # The gate GEMM (fp32, the skinny-GEMM op); everything after it is one op.
            logits = self.ops.linear_fp32(x, self.weight)
            out = self.ops.moe_route(logits, bias, tid2eid, ids, self.top_k, self.route_scale)
        return out if experts is None else (*out, None)


class Experts(nn.Module):
    """The routed experts of one layer, stacked: ``w1``/``w3`` logical [E, I, D], ``w2`` [E, D, I].

    Dense storage (CPU / torch path): the stacks in ``dtype``; a loaded ``QuantWeight`` is
    dequantized into its row.  Quantized storage (``keep_quantized``, default: built on CUDA;
    see ``dsv4.model.layers.keeps_quantized``) of quantized checkpoints keeps the checkpoint
    format, as the Triton expert kernel reads it: MXFP4 int8 [E, N, K/2] + e8m0 scales
    [E, N, K/32], or FP8 e4m3 [E, N, K] + block scales [E, N/B, K/B] (*-Base).  A quantized
    storage only accepts ``QuantWeight`` values of that format (a dense value would have to be
    re-quantized, which loses precision: an error instead).

    Built on the ``meta`` device (``load_model``), the stacks hold nothing until the first
    expert of each arrives: one [E, ...] allocation on that expert's device, then each loaded
    expert is copied into its row (the grouped kernels need one tensor per stack), so loading
    never holds more than the stacks plus one expert matrix.
    """

    def __init__(self, cfg: ModelConfig, act_block: int | None, dtype: torch.dtype,
                 keep_quantized: bool | None = None, parallel: Parallel | None = None) -> None:
        super().__init__()
        e, i, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
        # Several ranks: expert parallel holds experts [lo, hi) whole; tensor parallel holds a
        # slice of every expert's intermediate dim (dsv4.dist.sharding).
        par = parallel or SINGLE
        self.expert_offset = 0
        self.routed_experts = e          # across expert-parallel ranks: the routing's spread
        if par.expert_parallel:
            self.expert_offset, hi = par.split(e, "n_routed_experts")
            e = hi - self.expert_offset
        else:
            i_lo, i_hi = par.split(i, "moe_intermediate_size")
            i = i_hi - i_lo
        if act_block and i % act_block:
            # The w2 input (this rank's slice of the intermediate dim) is FP8-quantized in blocks
            # of act_block under official numerics: a partial block would change the numerics.
            raise ValueError(f"Experts: this rank's slice of moe_intermediate_size ({i} of "
                             f"{cfg.moe_inter_dim}) is not a multiple of the activation block "
                             f"{act_block} of numerics 'official'; use fewer ranks, "
                             "expert_parallel=True or numerics 'bf16'")
        self.num_experts = e
        self.act_block = act_block
        self.block = cfg.weight_block_size
        quantized = cfg.quantized and cfg.expert_dtype in ("fp4", "fp8")
        self.fmt = cfg.expert_dtype if quantized and keeps_quantized(keep_quantized) else "dense"
        # MXFP4 stacks on a GPU are stored K-chunk-major (ExpertWeights.kchunk: each K step's
        # weight tile one contiguous run, ~11% faster expert GEMMs from 2 tokens per step,
        # docs/PERFORMANCE.md twelfth session); ``kchunk`` says what the stacks hold now.
        self.kchunk = 0
        # The stacks' FP8 re-encoding kept on the device (keep_fp8_codes), or None.
        self.fp8_codes: Any = None
        # The re-encoding started for the current step's call (MoE.encode_ahead), or None.
        self.ahead: Any = None
        k_step = expert_k_step(act_block, d, i)
        self.k_step = k_step if d % k_step == 0 and i % k_step == 0 else 0
        self.w1_scale: torch.Tensor | None = None
        self.w3_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        if self.fmt == "dense":
            self.w1 = nn.Parameter(torch.zeros(e, i, d, dtype=dtype), requires_grad=False)
            self.w3 = nn.Parameter(torch.zeros(e, i, d, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.zeros(e, d, i, dtype=dtype), requires_grad=False)
            return
        if self.fmt == "fp4":
            wdt, sdt = torch.int8, torch.float8_e8m0fnu
            wshape = {"w1": (e, i, d // 2), "w3": (e, i, d // 2), "w2": (e, d, i // 2)}
            sshape = {"w1": (e, i, d // FP4_BLOCK), "w3": (e, i, d // FP4_BLOCK),
                      "w2": (e, d, i // FP4_BLOCK)}
        else:
            b = self.block
            wdt = torch.float8_e4m3fn
            sdt = torch.float8_e8m0fnu if cfg.scale_dtype == "e8m0" else torch.float32
            wshape = {"w1": (e, i, d), "w3": (e, i, d), "w2": (e, d, i)}
            sshape = {"w1": (e, -(-i // b), -(-d // b)), "w3": (e, -(-i // b), -(-d // b)),
                      "w2": (e, -(-d // b), -(-i // b))}
        for name in ("w1", "w3", "w2"):
            setattr(self, name, nn.Parameter(torch.zeros(wshape[name], dtype=torch.uint8).view(
                wdt), requires_grad=False))
            scale = torch.full(sshape[name], 127, dtype=torch.uint8).view(sdt) \
                if sdt == torch.float8_e8m0fnu else torch.ones(sshape[name], dtype=sdt)
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def official_targets(self, prefix: str) -> dict[str, Callable[[Any], None]]:
        """Official tensor names of every expert matrix -> a function that loads it."""
        out: dict[str, Callable[[Any], None]] = {}
        for e in range(self.num_experts):
            for which in ("w1", "w2", "w3"):
                out[f"{prefix}{self.expert_offset + e}.{which}.weight"] = (
                    lambda v, e=e, which=which: self.load_expert(e, which, v))
        return out

    def _logical_shape(self, which: str) -> tuple[int, int]:
        stack: torch.Tensor = getattr(self, which)
        n, k = stack.shape[1], stack.shape[2]
        return (n, k * 2) if self.fmt == "fp4" else (n, k)

    def load_expert(self, e: int, which: str, value: Any) -> None:
        """Write expert ``e``'s ``which`` ("w1"/"w2"/"w3") matrix (dense or QuantWeight)."""
        stack: torch.Tensor = getattr(self, which)
        shape = self._logical_shape(which)
        got = tuple(getattr(value, "shape", ()))
        if got != shape:
            raise ValueError(f"experts.{e}.{which}.weight: expected logical shape {shape}; "
                             f"found {got}")
        if self.fmt == "dense":
            dense = _dense(value, stack.dtype)
            stack = self._materialize(which, dense.device)
            with torch.no_grad():
                stack[e].copy_(dense)
            return
        fmt = getattr(value, "fmt", "dense")
        if fmt != self.fmt or (fmt == "fp8" and value.block != self.block):
            raise ValueError(f"experts.{e}.{which}.weight: the quantized expert storage holds "
                             f"{self.fmt} (block {self.block if self.fmt == 'fp8' else 32}); "
                             f"found {fmt}" + (f" (block {value.block})" if fmt != "dense"
                                               else " (a dense tensor)"))
        scale: torch.Tensor = getattr(self, f"{which}_scale")
        if value.scale.dtype != scale.dtype:
            raise ValueError(f"experts.{e}.{which}.scale: expected {scale.dtype}; found "
                             f"{value.scale.dtype}")
        stack = self._materialize(which, value.weight.device)
        scale = getattr(self, f"{which}_scale")
        self.fp8_codes = None         # made from the stacks as they were
        w, s = value.weight.view(stack.dtype), value.scale
        if self.fmt == "fp4" and stack.is_cuda and self.k_step:
            w = rows_kchunk(w.view(torch.uint8), self.k_step // 2).view(stack.dtype)
            s = rows_kchunk(s.view(torch.uint8), self.k_step // FP4_BLOCK).view(s.dtype)
            self.kchunk = self.k_step
        with torch.no_grad():
            stack[e].copy_(w)
            scale[e].copy_(s)

    def relayout_kchunk(self) -> None:
        """Store MXFP4 stacks K-chunk-major in place (weights put in without
        :meth:`load_expert`, e.g. random ones made on the GPU, or a model moved there); a no-op
        for other formats, already chunked stacks, or widths without a K step."""
        if self.fmt != "fp4" or self.kchunk or not self.k_step:
            return
        chunked = kchunk_experts(self.weights(), self.k_step)
        self.fp8_codes = None
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(self, name).copy_(getattr(chunked, name))
                getattr(self, f"{name}_scale").copy_(getattr(chunked, "s" + name[1]))
        self.kchunk = self.k_step

    def keep_fp8_codes(self) -> int:
        """Make the MXFP4 stacks' lossless FP8 re-encoding and keep it on the device, so that
        large prefill steps run the FP8-MMA expert GEMMs without re-encoding the experts each
        time (``triton_moe_fp8.encode_fp8_codes``; the engine option ``moe_fp8_codes``).
        Returns its bytes; 0 (nothing kept) off CUDA, for other formats, and for stacks the
        FP8-MMA path does not run (a scale spread beyond its exact range)."""
        from dsv4.ops import triton_moe_fp8
        self.fp8_codes = None
        if self.fmt != "fp4" or not self.w1.is_cuda:
            return 0
        self.fp8_codes = triton_moe_fp8.encode_fp8_codes(self.weights())
        return self.fp8_codes.nbytes() if self.fp8_codes is not None else 0

    def _materialize(self, which: str, device: torch.device) -> torch.Tensor:
        """The stack ``which`` (and its scales), given storage on ``device`` by the first expert
        loaded into a model built on ``meta``: one [E, ...] allocation, no zero fill (every row
        is loaded: ``Transformer.load_tensors`` checks the names first)."""
        for name in (which, f"{which}_scale"):
            current = getattr(self, name)
            if current is not None and current.is_meta:
                set_parameter(self, name, torch.empty(current.shape, dtype=current.dtype,
                                                      device=device))
        return getattr(self, which)

    def weights(self) -> ExpertWeights:
        if self.fmt == "dense":
            return ExpertWeights(self.w1, self.w3, self.w2, self.act_block,
                                 routed_experts=self.routed_experts)
        codes = self.fp8_codes if self.fp8_codes is not None else self.ahead
        return ExpertWeights(self.w1, self.w3, self.w2, self.act_block, self.fmt,
                             self.w1_scale, self.w3_scale, self.w2_scale, self.block,
                             self.kchunk, codes, self.routed_experts)


class SharedExpert(nn.Module):
    """The always-on expert: FP8 ``w1``/``w3`` [I, D], ``w2`` [D, I], SwiGLU with the clamp
    (the current V4 release clamps the shared expert too, spec §6.1)."""

    def __init__(self, cfg: ModelConfig, fmt: str, numerics: str, dtype: torch.dtype,
                 parallel: Parallel | None = None, ops: SimpleNamespace | None = None) -> None:
        super().__init__()
        self.ops = ops if ops is not None else get_ops("torch")
        b, d = cfg.weight_block_size, cfg.dim
        # Tensor parallel (with or without expert parallel): a slice of the intermediate dim.
        i_lo, i_hi = (parallel or SINGLE).split(cfg.moe_inter_dim, "moe_intermediate_size")
        i = i_hi - i_lo
        self.swiglu_limit = cfg.swiglu_limit
        self.w1 = Linear(d, i, fmt=fmt, block=b, numerics=numerics, dtype=dtype)
        self.w2 = Linear(i, d, fmt=fmt, block=b, numerics=numerics, dtype=dtype)
        self.w3 = Linear(d, i, fmt=fmt, block=b, numerics=numerics, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # w1 and w3 read the same x: one GEMM on the GPU.  One op for the clamp + silu +
        # product + rounding to x's dtype (w2's input).
        gate, up = fused_linears(x, (self.w1, self.w3))
        a = self.ops.swiglu_act(gate, up, self.swiglu_limit, x.dtype)
        return self.w2(a)


class MoE(nn.Module):
    """``ffn`` of block ``layer_id``: ``gate``, ``experts``, ``shared_experts``.

    ``forward(x [T, D], input_ids [T]) -> [T, D]`` in x.dtype.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, numerics: str, ops: SimpleNamespace,
                 dtype: torch.dtype, parallel: Parallel | None = None) -> None:
        super().__init__()
        check_numerics(numerics)
        self.parallel = parallel or SINGLE
        if cfg.n_shared_experts != 1:
            raise ValueError(f"MoE: n_shared_experts must be 1; found {cfg.n_shared_experts}")
        self.layer_id = layer_id
        self.ops = ops
        self.dtype = dtype            # the compute dtype: the experts' input
        self.swiglu_limit = cfg.swiglu_limit
        shared_fmt = "fp8" if cfg.quantized else "bf16"
        expert_quantized = cfg.quantized and cfg.expert_dtype in ("fp4", "fp8")
        # Under official numerics a quantized expert GEMM sees FP8 fake-quantized inputs (§2.5).
        act_block = cfg.weight_block_size if numerics == "official" and expert_quantized else None
        self.gate = Gate(cfg, layer_id, ops, dtype)
        self.experts = Experts(cfg, act_block, dtype, parallel=self.parallel)
        # Several ranks: the shared expert is split, or held whole by rank 0 when its slices
        # would cut FP8 scale blocks (None on the other ranks; dsv4.dist.sharding).
        self.shared_experts: SharedExpert | None = None
        par = self.parallel
        if not par.enabled or splits_shared_expert(cfg, par.world_size):
            self.shared_experts = SharedExpert(cfg, shared_fmt, numerics, dtype, par, ops)
        elif par.is_driver:
            self.shared_experts = SharedExpert(cfg, shared_fmt, numerics, dtype, ops=ops)

    def encode_ahead(self, tokens: int) -> None:
        """Called when the block starts a step of ``tokens`` tokens: start
        what the routed experts' call can prepare from the weights alone (``ops.moe_encode_ahead``:
        the FP8 re-encoding of MXFP4 stacks for large prefill steps, on a stream of its own),
        so it runs beside the attention; the next :meth:`forward` uses it."""
        start = getattr(self.ops, "moe_encode_ahead", None)
        self.experts.ahead = None
        if start is not None and self.experts.fp8_codes is None:
            self.experts.ahead = start(self.experts.weights(), tokens, self.gate.top_k,
                                       self.dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``image_mask`` [T] bool (V4.1 only): image-span tokens route with ``bias_vl``."""
        if x.dim() != 2 or input_ids.shape != (x.shape[0],):
            raise ValueError(f"MoE: expected x [T, D] and input_ids [T]; found {tuple(x.shape)} "
                             f"and {tuple(input_ids.shape)}")
        shared = None
        if self.shared_experts is not None:
            # Independent of the routing: on the GPU a second stream runs it next to the gate
            # and the routed experts (dsv4.ops.streams; joined below before any use).
            with side_lane(x.device, x.shape[0]):
                shared = self.shared_experts(x)
        experts = self.experts.weights()
        self.experts.ahead = None     # one call per encode_ahead: its scratch is shared
        plan = None
        if self.parallel.enabled or self.experts.expert_offset or image_mask is not None:
            weights, ids = self.gate(x, input_ids, image_mask)
        else:
            # One rank: at decode the gate's launch also makes the experts' plan.
            weights, ids, plan = self.gate(x, input_ids, experts=experts)
        if self.experts.expert_offset:
            ids = ids - self.experts.expert_offset  # local ids; other ranks' experts are skipped
        with_plan = {} if plan is None else {"plan": plan}
        fused = getattr(self.ops, "moe_experts_shared", None)
        if shared is not None and not self.parallel.enabled and fused is not None:
            # One rank: routed + shared summed in the experts' last launch, which joins the
            # shared expert's lane only after the routed GEMMs were issued.
            device = x.device
            out = fused(x, ids, weights, experts, self.swiglu_limit, shared,
                        lambda: join_side_lane(device), **with_plan)
            join_side_lane(device)  # a no-op once the op has joined
            return out
        routed = self.ops.moe_experts(x, ids, weights, experts, self.swiglu_limit, **with_plan)
        join_side_lane(x.device)
        if shared is not None and not self.parallel.enabled:
            # One rank: the fp32 sum and the rounding to x's dtype in one op.
            return self.ops.moe_combine(routed, shared, x.dtype)
        if shared is not None:
            routed = routed + shared.float()
        # Several ranks: fp32 partial sums (routed + shared) are summed over the ranks.
        return self.parallel.all_reduce(routed).to(x.dtype)
