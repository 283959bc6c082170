"""Basic layers: ``Linear`` (quantized storage or not), ``RMSNorm`` and the per-layer RoPE tables.

Spec: MODEL.md §2.4–2.5 (formats, run-time activation quantization), §3.1 (RMSNorm, RoPE
convention), §3.2 (per-layer RoPE base and YaRN).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from dsv4.config import ModelConfig
from dsv4.ops.torch_dense import batch_invariant_linear

__all__ = ["Linear", "RMSNorm", "fused_linears", "stacked_weight", "rope_cos_sin", "rope_inv_freq",
           "yarn_correction_range", "rope_params", "WEIGHT_FORMATS", "NUMERICS", "quantized_storage",
           "keeps_quantized", "load_device", "set_parameter", "exact_fp8_copy"]

WEIGHT_FORMATS = ("fp8", "fp4", "bf16", "f32")
NUMERICS = ("bf16", "official")


def check_numerics(numerics: str) -> str:
    """Return ``numerics`` or raise a ValueError naming the allowed values."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics={numerics!r} is not supported; allowed: {NUMERICS}")
    return numerics


# None: keep quantized weights quantized exactly when the module is built on a CUDA device.
_KEEP_QUANTIZED: bool | None = None


@contextlib.contextmanager
def quantized_storage(enabled: bool = True) -> Iterator[None]:
    """Build modules (``Linear``, routed experts) that keep their checkpoint formats (FP8,
    MXFP4) whatever the device; ``enabled=False`` forces dense storage.  Outside this context
    the choice follows the default device: quantized on CUDA, dense elsewhere."""
    global _KEEP_QUANTIZED
    prev, _KEEP_QUANTIZED = _KEEP_QUANTIZED, enabled
    try:
        yield
    finally:
        _KEEP_QUANTIZED = prev


def keeps_quantized(flag: bool | None = None) -> bool:
    """The storage choice of a module being built: ``flag`` if given, else the innermost
    :func:`quantized_storage`, else whether the default device is CUDA."""
    if flag is not None:
        return flag
    if _KEEP_QUANTIZED is not None:
        return _KEEP_QUANTIZED
    return torch.get_default_device().type == "cuda"


def fp32_math_dtype(compute_dtype: torch.dtype, flag: bool | None = None) -> torch.dtype:
    """Storage dtype of a bf16 checkpoint weight the reference promotes to fp32 (the
    compressors' ``wkv`` / ``wgate``, the MoE gate): the checkpoint's bf16 with quantized (GPU)
    storage and a bf16 / fp16 compute dtype — ``linear_fp32`` widens it exactly, so the math is
    the same at half the bytes — else fp32 (the CPU path, bit for bit as before)."""
    narrow = compute_dtype in (torch.bfloat16, torch.float16)
    return torch.bfloat16 if narrow and keeps_quantized(flag) else torch.float32


def load_device(current: Tensor, value_device: torch.device) -> torch.device:
    """Where a loaded value goes: the value's own device when ``current`` is a ``meta``
    placeholder (the model was built without storage), else ``current``'s device."""
    return value_device if current.is_meta else current.device


def set_parameter(module: nn.Module, name: str, value: Tensor) -> None:
    """Make ``value`` (adopted, not copied) the parameter or buffer ``module.name``.

    A new ``Parameter`` object replaces the old one: ``.data`` assignment cannot turn a
    ``meta`` placeholder into real storage."""
    if name in module._buffers:
        module._buffers[name] = value
    else:
        setattr(module, name, nn.Parameter(value, requires_grad=False))


def _default_ops() -> SimpleNamespace:
    from dsv4.ops import get_ops
    return get_ops("torch")


class Linear(nn.Module):
    """A bias-free linear layer ``y = x W^T`` whose checkpoint weight may be quantized.

    ``fmt`` is the checkpoint storage: "fp8" (block-scaled e4m3), "fp4" (MXFP4), "bf16" or "f32".
    ``block`` is the FP8 block size of the run-time activation quantization (and of fp8 weights).

    Two storages:

    * dense (the CPU/torch path): ``weight`` [out, in] in ``dtype``; a loaded
      ``dsv4.formats.QuantWeight`` is dequantized into it (and also kept in ``self.qweight``).
      With ``numerics="official"`` and a quantized ``fmt``, the input activation is
      fake-quantized to FP8 (power-of-two scales per ``block`` inputs, spec §2.5) before the
      GEMM, as the reference's fp8/fp4 GEMMs do.
    * quantized (``fmt="fp8"`` built with :func:`keeps_quantized` true: on CUDA by default):
      ``weight`` is an empty [0, in] placeholder and a loaded FP8 ``QuantWeight`` stays in
      ``self.qweight`` (half the bytes of bf16); ``forward`` calls ``fp8_linear`` (the Triton
      kernel on CUDA tensors, its torch twin elsewhere), which always quantizes the input
      activation to FP8 as the reference does, whatever ``numerics`` says.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "bf16", block: int = 128,
                 numerics: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 keep_quantized: bool | None = None) -> None:
        super().__init__()
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"Linear: fmt={fmt!r} is not supported; allowed: {WEIGHT_FORMATS}")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: features must be positive; got in={in_features}, "
                             f"out={out_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.block = block
        self.numerics = check_numerics(numerics)
        # Only FP8 has a GPU kernel behind a Linear; other formats are held dense.
        self.quantized_storage = fmt == "fp8" and keeps_quantized(keep_quantized)
        rows = 0 if self.quantized_storage else out_features
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype),
                                   requires_grad=False)
        self.qweight: Any = None

    @property
    def quantizes_input(self) -> bool:
        return self.numerics == "official" and self.fmt in ("fp8", "fp4")

    def load_weight(self, t: Any) -> None:
        """Set the weight from a dense tensor or a ``QuantWeight`` (kept as it is by a quantized
        storage when it is FP8, dequantized otherwise).

        A module built on the ``meta`` device (``load_model``) takes the value's device and
        adopts the value when it already has the weight's dtype (no copy); a module with real
        storage keeps its device."""
        shape = (self.out_features, self.in_features)
        if isinstance(t, Tensor):
            if tuple(t.shape) != shape:
                raise ValueError(f"Linear.load_weight: weight has shape {tuple(t.shape)}; "
                                 f"expected {shape}")
            dense = t
            self.qweight = None
        elif hasattr(t, "dequantize"):
            tshape = tuple(getattr(t, "shape", shape))
            if tshape != shape:
                raise ValueError(f"Linear.load_weight: quantized weight has logical shape {tshape};"
                                 f" expected {shape}")
            if self.quantized_storage and getattr(t, "fmt", None) == "fp8":
                self._load_quantized(t)
                return
            dense = t.dequantize(self.weight.dtype)
            self.qweight = t
        else:
            raise ValueError(f"Linear.load_weight: expected a Tensor or QuantWeight; got "
                             f"{type(t).__name__}")
        device = load_device(self.weight, dense.device)
        set_parameter(self, "weight", dense.to(device=device, dtype=self.weight.dtype))

    def _load_quantized(self, t: Any) -> None:
        """Keep an FP8 ``QuantWeight`` as it is (moved to this module's device)."""
        if t.block != self.block:
            raise ValueError(f"Linear.load_weight: FP8 weight has block {t.block}; expected "
                             f"{self.block}")
        device = load_device(self.weight, t.device)
        self.qweight = t if t.device == device else t.to(device)
        set_parameter(self, "weight", torch.empty(0, self.in_features, dtype=self.weight.dtype,
                                                  device=device))

    @property
    def holds_quantized(self) -> bool:
        """True when ``forward`` runs the FP8 kernel on ``qweight`` (no dense weight held)."""
        return self.qweight is not None and self.weight.shape[0] == 0

    def forward(self, x: Tensor) -> Tensor:
        """[..., in] -> [..., out] in x.dtype (GEMM in the weight's dtype, fp32 accumulation)."""
        if self.holds_quantized:
            from dsv4.ops import get_ops
            qw = self.qweight
            ops = get_ops("triton" if x.is_cuda else "torch")
            return ops.fp8_linear(x, qw.weight, qw.scale, self.block, x.dtype)
        if self.weight.shape[0] != self.out_features:
            raise ValueError(f"Linear({self.in_features}->{self.out_features}): no weight loaded "
                             f"(quantized storage waits for an FP8 QuantWeight)")
        if self.quantizes_input:
            from dsv4.formats import fake_quant_fp8
            x = fake_quant_fp8(x, self.block)
        # Batch-invariant on CPU: decode rows bit-identical to prefill rows (with MKL_CBWR).
        return batch_invariant_linear(x.to(self.weight.dtype), self.weight).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, "
                f"numerics={self.numerics}, quantized_storage={self.quantized_storage}")


def fused_linears(x: Tensor, linears: Sequence[Linear]) -> list[Tensor]:
    """``[lin(x) for lin in linears]`` as ONE FP8 GEMM when every Linear runs the FP8 kernel on
    the GPU (``holds_quantized``, CUDA input), else each Linear on its own.

    Projections that read the same input (the attention's ``wq_a`` and ``wkv``, the shared
    expert's ``w1`` and ``w3``) then share one activation quantization and one launch: at decode
    each GEMM is a few µs of latency over a few MB.  The first call re-stores the weights and
    scales as row slices of one tensor (no second copy is kept: each Linear's ``qweight`` becomes
    a view of its rows); a reload of any of them (a new ``qweight``) fuses again.  Each output
    column is the same dot product as unfused (the kernel's K-split plan may differ: equal to
    fp32 rounding).  The outputs are column slices of one [T, ΣN] tensor (row stride ΣN).
    """
    first = linears[0]
    if len(linears) > 1 and _fuses_on(x) and all(lin.holds_quantized for lin in linears):
        key = tuple(id(lin.qweight) for lin in linears)
        group = first.__dict__.get("_fused_group")
        if group is None or group[0] != key:
            # Never inside a CUDA-graph capture (allocations there belong to the graph).
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            group = None if capturing else _fuse_rows(linears)
            if group is not None:
                first.__dict__["_fused_group"] = group
        if group is not None:
            from dsv4.ops import get_ops
            _, w, scale, sizes = group
            y = get_ops("triton").fp8_linear(x, w, scale, first.block, x.dtype)
            return list(y.split(sizes, dim=-1))
    return [lin(x) for lin in linears]


def stacked_weight(x: Tensor, linears: Sequence[Linear]) -> Tensor | None:
    """The dense weights of ``linears`` (which all read ``x``) as one [ΣN, K] tensor whose row
    slices are the Linears' own weights, for one GEMM in place of several (the compressors'
    fp32 ``wkv`` + ``wgate``); None off the GPU (see :func:`fused_linears`), inside a CUDA-graph
    capture before the first stacking, or when the weights cannot stack (dtype, width, device,
    quantized storage).  The first call re-stores the weights (no second copy kept); a reload
    of any of them stacks again."""
    first = linears[0]
    if not _fuses_on(x):
        return None
    key = tuple(id(lin.weight) for lin in linears)
    group = first.__dict__.get("_stacked_weight")
    if group is not None and group[0] == key:
        return group[1]
    w0 = first.weight
    if (x.is_cuda and torch.cuda.is_current_stream_capturing()) or any(
            lin.holds_quantized or lin.weight.shape != (lin.out_features, lin.in_features)
            or lin.weight.dtype != w0.dtype or lin.in_features != first.in_features
            or lin.weight.device != w0.device for lin in linears):
        return None
    w = torch.cat([lin.weight for lin in linears])
    row = 0
    for lin in linears:
        set_parameter(lin, "weight", w[row:row + lin.out_features])
        row += lin.out_features
    first.__dict__["_stacked_weight"] = (tuple(id(lin.weight) for lin in linears), w)
    return w


def exact_fp8_copy(lin: Linear) -> tuple[Tensor, Tensor] | None:
    """(e4m3 weight, e8m0 block scales) of a dense bf16 Linear whose values are exactly an FP8
    block weight — ``attn.wo_a``, which the loader dequantizes from the checkpoint's FP8 as the
    reference does — for the 1-2-row FP8 GEMV (half the bytes; same products).  Re-quantized
    with power-of-two scales on first use and kept only if it dequantizes back to the same
    bits (the e8m0 checkpoints; not the fp32-scale *-Base ones): else None.  Never made
    inside a CUDA-graph capture (None until an eager call made it); a reload makes it again."""
    w = lin.weight
    cache = lin.__dict__.get("_exact_fp8")
    if cache is not None and cache[0] == id(w):
        return cache[1]
    if (w.dtype != torch.bfloat16 or w.shape != (lin.out_features, lin.in_features)
            or (w.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    from dsv4.formats import dequant_fp8_block, quant_fp8_block
    w8, scale = quant_fp8_block(w, lin.block, "e8m0")
    exact = torch.equal(dequant_fp8_block(w8, scale, lin.block, w.dtype), w)
    copy = (w8, scale) if exact else None
    lin.__dict__["_exact_fp8"] = (id(w), copy)
    return copy


def _fuses_on(x: Tensor) -> bool:
    """Where :func:`fused_linears` fuses: CUDA inputs (the CPU path keeps each GEMM: its
    dense twins are batch-invariant per Linear, which the CPU tests compare exactly)."""
    return x.is_cuda


def _fuse_rows(linears: Sequence[Linear]) -> tuple[tuple[int, ...], Tensor, Tensor,
                                                  list[int]] | None:
    """(key, weight, scale, sizes) of the Linears' FP8 weights stacked by rows, each Linear's
    ``qweight`` re-pointed at its slice; None when they cannot share one GEMM (other input
    width, block, scale dtype, or an output count that is not a whole number of scale blocks)."""
    from dsv4.formats import QuantWeight

    first = linears[0]
    b = first.block
    qws = [lin.qweight for lin in linears]
    if any(lin.in_features != first.in_features or lin.block != b or lin.out_features % b
           or qw.fmt != "fp8" or qw.scale.dtype != qws[0].scale.dtype
           or qw.device != qws[0].device for lin, qw in zip(linears, qws)):
        return None
    w = torch.cat([qw.weight for qw in qws])
    scale = torch.cat([qw.scale for qw in qws])
    sizes, row = [], 0
    for lin in linears:
        n = lin.out_features
        lin.qweight = QuantWeight(w[row:row + n], scale[row // b:(row + n) // b], "fp8", b,
                                  (n, lin.in_features))
        sizes.append(n)
        row += n
    return tuple(id(lin.qweight) for lin in linears), w, scale, sizes


class RMSNorm(nn.Module):
    """``y = w · x · rsqrt(mean(x²) + eps)`` with fp32 math and weight, output in x.dtype."""

    def __init__(self, dim: int, eps: float, ops: SimpleNamespace | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.ops = ops if ops is not None else _default_ops()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: input has last dim {x.shape[-1]}; expected {self.dim}")
        return self.ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


# ---------------------------------------------------------------------------------- RoPE
def yarn_correction_range(rd: int, base: float, original_seq_len: int, beta_fast: float,
                          beta_slow: float) -> tuple[int, int]:
    """YaRN's (low, high) channel-pair bounds of spec §3.2 (15, 25 for the V4-Flash values)."""
    def dim_of(rotations: float) -> float:
        return rd * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rd - 1)
    return low, high


def rope_params(cfg: ModelConfig, layer_id: int) -> tuple[float, bool]:
    """(base, use_yarn) of a layer: compressed layers use compress θ + YaRN (spec §3.2)."""
    if cfg.ratio(layer_id) > 0:
        return cfg.compress_rope_theta, cfg.original_seq_len > 0
    return cfg.rope_theta, False


_inv_freq_cache: dict[tuple, Tensor] = {}


def rope_inv_freq(cfg: ModelConfig, layer_id: int, device: torch.device | str = "cpu") -> Tensor:
    """[rd/2] fp32 rotation frequencies of layer ``layer_id`` (cached per device)."""
    base, yarn = rope_params(cfg, layer_id)
    rd = cfg.rope_head_dim
    key = (rd, base, yarn, cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow,
           str(torch.device(device)))
    freq = _inv_freq_cache.get(key)
    if freq is None:
        freq = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        if yarn:
            low, high = yarn_correction_range(rd, base, cfg.original_seq_len, cfg.beta_fast,
                                              cfg.beta_slow)
            hi = high + 0.001 if low == high else high
            ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / (hi - low)).clamp(0, 1)
            smooth = 1 - ramp
            freq = freq / cfg.rope_factor * (1 - smooth) + freq * smooth
        freq = freq.to(device)
        _inv_freq_cache[key] = freq
    return freq


def rope_cos_sin(cfg: ModelConfig, layer_id: int, positions: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin) fp32 [T, rd/2] of the layer's rotation at ``positions`` [T].

    Equal, element for element, to rows of a precomputed ``outer(arange(max_len), freq)`` table
    (one fp32 product per entry), without holding a table of max_seq_len rows.
    No YaRN attention factor (mscale) is applied (spec §3.2).
    """
    if positions.dim() != 1:
        raise ValueError(f"rope_cos_sin: positions must be 1-D [T]; got shape "
                         f"{tuple(positions.shape)}")
    freq = rope_inv_freq(cfg, layer_id, positions.device)
    angles = positions.to(torch.float32)[:, None] * freq[None, :]
    return torch.cos(angles), torch.sin(angles)
