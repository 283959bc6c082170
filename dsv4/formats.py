"""Every number format of the DeepSeek-V4 family, in one place (spec §2.4, §2.5).

Storage formats (checkpoint tensors):

* ``e4m3`` — ``torch.float8_e4m3fn`` (OCP "fn": max 448, no inf);
* ``e8m0`` — ``torch.float8_e8m0fnu``, one unsigned byte ``b`` worth ``2^(b − 127)`` (255 = NaN);
* ``fp8`` block weights — e4m3 ``[N, K]`` with one scale (e8m0 or float32) per ``B×B`` block;
* ``fp4`` (MXFP4) weights — int8 ``[N, K/2]`` holding two e2m1 codes per byte (the LOW nibble is
  the even input index ``k = 2j``, the HIGH nibble ``k = 2j+1``) and one e8m0 scale per 32
  inputs, ``[N, K/32]``;
* ``mxfp8`` — e4m3 ``[N, K]`` with one e8m0 scale per 32 inputs ``[N, K/32]`` (the V4.1 Engram
  tables).

Run-time fake quantization (the reference's ``act_quant`` / ``fp4_act_quant``), computed in fp32
exactly as the reference kernels do (scale by ``amax · (1/max)``, power-of-two scales through
the float's exponent bits, ``x / s``, round-to-nearest-even) and returned in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "E4M3_MAX", "E2M1_MAX", "FP4_BLOCK", "MX_BLOCK", "E2M1_VALUES", "FORMATS",
    "e8m0_to_float", "float_to_e8m0", "pow2_ceil", "e4m3_to_float", "float_to_e4m3",
    "resolve_scale_dtype", "dequant_fp8_block", "quant_fp8_block",
    "pack_e2m1", "unpack_e2m1", "e2m1_codes", "dequant_mxfp4", "quant_mxfp4",
    "dequant_mxfp8", "quant_mxfp8",
    "act_quant", "fake_quant_fp8", "fake_quant_fp4", "hadamard_transform", "QuantWeight",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP4_BLOCK = 32  # MXFP4 / MXFP8: one e8m0 scale per 32 inputs
MX_BLOCK = FP4_BLOCK
# Magnitudes of the 8 e2m1 codes (bit 3 is the sign): the 16-entry table is this and its negation.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES: tuple[float, ...] = _E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES)
FORMATS = ("fp8", "fp4", "mxfp8")

# Reciprocals as the reference kernels use them: a Python double constant rounded to fp32.
_E4M3_MAX_INV = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()
_E2M1_MAX_INV = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32).item()
_FP8_AMAX_FLOOR = 1e-4
_FP4_AMAX_FLOOR_E8M0 = 6.0 * 2.0 ** -126
_FP4_AMAX_FLOOR_E4M3 = 6.0 * 2.0 ** -9


# ------------------------------------------------------------------------------ scalar formats
def e8m0_to_float(scale: Tensor) -> Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or ``uint8``) -> float32 ``2^(b − 127)``; b = 255 -> NaN."""
    if scale.dtype == torch.float8_e8m0fnu:
        b = scale.view(torch.uint8)
    elif scale.dtype == torch.uint8:
        b = scale
    else:
        raise ValueError(f"e8m0_to_float: expected a float8_e8m0fnu or uint8 tensor, found "
                         f"{scale.dtype}")
    b = b.to(torch.int32)
    # Build the float32 bit pattern directly: exact for every byte, including 2^-127 (subnormal).
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _exponent_ceil(x: Tensor) -> Tensor:
    """ceil(log2(x)) + 127 of positive fp32 values via the exponent bits (the reference's
    ``fast_log2_ceil``); exact for normal numbers."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    return exp + (mant != 0).to(torch.int32)


def pow2_ceil(x: Tensor) -> Tensor:
    """``2^ceil(log2(x))`` of positive normal fp32 values, exactly (the reference's
    ``fast_round_scale``); returns float32."""
    e = _exponent_ceil(x).clamp(1, 254)
    return (e << 23).view(torch.float32)


def float_to_e8m0(x: Tensor) -> Tensor:
    """Positive floats -> ``float8_e8m0fnu``, rounding up to a power of two (powers of two are
    exact).  Values at or below 2^-127 give 2^-127; above 2^127 saturate; NaN gives NaN (255)."""
    xf = x.to(torch.float32)
    if bool((xf < 0).any()):
        raise ValueError("float_to_e8m0: scales must be non-negative")
    bits = xf.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    b = exp + (mant != 0).to(torch.int32)
    # fp32 subnormals: 2^-127 itself is exponent byte 0; anything between it and 2^-126 rounds up.
    sub = exp == 0
    b = torch.where(sub & (xf <= 2.0 ** -127), torch.zeros_like(b), b)
    b = torch.where(sub & (xf > 2.0 ** -127), torch.ones_like(b), b)
    b = b.clamp(0, 254)
    b = torch.where(torch.isnan(xf), torch.full_like(b, 255), b)
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


def e4m3_to_float(x: Tensor) -> Tensor:
    """``float8_e4m3fn`` -> float32 (exact)."""
    if x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"e4m3_to_float: expected a float8_e4m3fn tensor, found {x.dtype}")
    return x.to(torch.float32)


def float_to_e4m3(x: Tensor) -> Tensor:
    """Floats -> ``float8_e4m3fn``: round to nearest even, saturating at ±448 (NaN stays NaN)."""
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def resolve_scale_dtype(scale_dtype: str | torch.dtype) -> torch.dtype:
    """"e8m0"/"ue8m0" -> ``float8_e8m0fnu``; "fp32"/"float32" -> ``float32`` (dtypes pass)."""
    if isinstance(scale_dtype, torch.dtype):
        if scale_dtype in (torch.float8_e8m0fnu, torch.float32):
            return scale_dtype
    elif scale_dtype in ("e8m0", "ue8m0"):
        return torch.float8_e8m0fnu
    elif scale_dtype in ("fp32", "float32", "f32"):
        return torch.float32
    raise ValueError(f"scale dtype {scale_dtype!r} is not supported; allowed: 'e8m0' "
                     f"(float8_e8m0fnu) or 'fp32' (float32)")


def _scale_to_float(scale: Tensor) -> Tensor:
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float(scale)
    if scale.dtype == torch.float32:
        return scale
    raise ValueError(f"block scale: expected float8_e8m0fnu or float32, found {scale.dtype}")


# ------------------------------------------------------------------------------ FP8 block weights
def dequant_fp8_block(w8: Tensor, scale: Tensor, block: int,
                      dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``W[n, k] = e4m3(w8[n, k]) · scale[n // B, k // B]`` in ``dtype``.

    ``w8`` [N, K] float8_e4m3fn; ``scale`` [ceil(N/B), ceil(K/B)] e8m0 or float32.
    """
    if w8.dtype != torch.float8_e4m3fn or w8.dim() != 2:
        raise ValueError(f"dequant_fp8_block: weight must be a 2-D float8_e4m3fn tensor, found "
                         f"{w8.dtype} {tuple(w8.shape)}")
    n, k = w8.shape
    want = (-(-n // block), -(-k // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequant_fp8_block: scale of a [{n}, {k}] weight with block {block} must "
                         f"have shape {list(want)}, found {list(scale.shape)}")
    s = _scale_to_float(scale)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w8.to(torch.float32) * s).to(dtype)


def _pad_to(x: Tensor, rows: int, cols: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def quant_fp8_block(w: Tensor, block: int = 128,
                    scale_dtype: str | torch.dtype = "e8m0") -> tuple[Tensor, Tensor]:
    """Quantize a 2-D weight to FP8 blocks: returns (e4m3 [N, K], scale [ceil(N/B), ceil(K/B)]).

    e8m0 scales are ``2^ceil(log2(amax/448))`` (as the reference's converters write them);
    float32 scales are ``amax/448`` (as in the *-Base checkpoints).
    """
    if w.dim() != 2:
        raise ValueError(f"quant_fp8_block: expected a 2-D weight, found shape {tuple(w.shape)}")
    sdt = resolve_scale_dtype(scale_dtype)
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wf = _pad_to(w.to(torch.float32), nb * block, kb * block)
    blocks = wf.view(nb, block, kb, block)
    # The floor keeps an all-zero block finite (its codes are all 0 whatever the scale).
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    s = pow2_ceil(amax * _E4M3_MAX_INV) if sdt == torch.float8_e8m0fnu else amax / E4M3_MAX
    q = float_to_e4m3(blocks / s[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    scale = float_to_e8m0(s) if sdt == torch.float8_e8m0fnu else s
    return q.contiguous(), scale


# ------------------------------------------------------------------------------ e2m1 / MXFP4
def e2m1_codes(x: Tensor) -> Tensor:
    """Round floats onto the e2m1 grid ``±{0, .5, 1, 1.5, 2, 3, 4, 6}`` and return their 4-bit
    codes (uint8, sign in bit 3): round to nearest, ties to the even code, saturating at ±6."""
    xf = x.to(torch.float32)
    a = xf.abs()
    # The magnitude code counts the midpoints below |x|.  A tie at a midpoint goes to the even
    # code: strictly-above for midpoints whose upper neighbour is odd, at-or-above otherwise.
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0)).to(torch.uint8)
    mag = torch.where(torch.isnan(a), torch.full_like(mag, 7), mag)
    sign = torch.signbit(xf).to(torch.uint8) << 3
    return mag | sign


_E2M1_TABLES: dict[str, Tensor] = {}


def _e2m1_table(device: torch.device) -> Tensor:
    # Cached per device: building it is a host-to-device copy, which a CUDA graph capture of a
    # step that fake-quantizes to FP4 (official numerics) cannot contain.
    key = str(torch.device(device))
    table = _E2M1_TABLES.get(key)
    if table is None:
        table = _E2M1_TABLES[key] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return table


def pack_e2m1(codes: Tensor) -> Tensor:
    """Codes [..., K] (0..15) -> int8 [..., K/2]: byte j = code[2j] | code[2j+1] << 4."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last dim must be even, found {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    if bool((c > 15).any()):
        raise ValueError("pack_e2m1: codes must be in 0..15")
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return packed.view(torch.int8)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """int8/uint8 [..., K/2] -> codes uint8 [..., K] (low nibble = even index k = 2j)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"unpack_e2m1: expected an int8 or uint8 tensor, found {packed.dtype}")
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def dequant_mxfp4(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """MXFP4 weight -> dense: ``W[n, k] = e2m1(nibble(n, k)) · 2^(scale[n, k // 32] − 127)``.

    ``w`` int8 [N, K/2] packed codes; ``scale`` e8m0 [N, K/32].
    """
    if w.dim() != 2:
        raise ValueError(f"dequant_mxfp4: expected a 2-D packed weight, found {tuple(w.shape)}")
    n, k = w.shape[0], w.shape[1] * 2
    if k % FP4_BLOCK or tuple(scale.shape) != (n, k // FP4_BLOCK):
        raise ValueError(f"dequant_mxfp4: a [{n}, {k}] MXFP4 weight needs scale shape "
                         f"[{n}, {k // FP4_BLOCK}] (K a multiple of 32), found {list(scale.shape)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"dequant_mxfp4: scale must be float8_e8m0fnu, found {scale.dtype}")
    vals = _e2m1_table(w.device)[unpack_e2m1(w).to(torch.int64)]
    s = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, dim=1)
    return (vals * s).to(dtype)


def quant_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D weight [N, K] to MXFP4: (int8 [N, K/2], e8m0 scale [N, K/32]).

    Per 32 inputs: ``s = 2^ceil(log2(amax/6))``, codes = e2m1 RNE of ``w/s`` (the scale rule of
    the reference's fp4 quantizer).
    """
    if w.dim() != 2 or w.shape[1] % FP4_BLOCK:
        raise ValueError(f"quant_mxfp4: expected a 2-D weight with K a multiple of 32, found "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    blocks = w.to(torch.float32).view(n, k // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(-1).clamp_min(_FP4_AMAX_FLOOR_E8M0)
    s = pow2_ceil(amax * _E2M1_MAX_INV)
    codes = e2m1_codes((blocks / s[..., None]).clamp(-E2M1_MAX, E2M1_MAX)).view(n, k)
    return pack_e2m1(codes), float_to_e8m0(s)


def dequant_mxfp8(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """MXFP8 rows -> dense: ``W[n, k] = e4m3(w[n, k]) · 2^(scale[n, k // 32] − 127)``."""
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise ValueError(f"dequant_mxfp8: weight must be a 2-D float8_e4m3fn tensor, found "
                         f"{w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if k % MX_BLOCK or tuple(scale.shape) != (n, k // MX_BLOCK):
        raise ValueError(f"dequant_mxfp8: a [{n}, {k}] weight needs scale shape "
                         f"[{n}, {k // MX_BLOCK}] (K a multiple of 32), found {list(scale.shape)}")
    s = e8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=1)
    return (w.to(torch.float32) * s).to(dtype)


def quant_mxfp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D weight [N, K] to MXFP8: (e4m3 [N, K], e8m0 scale [N, K/32])."""
    if w.dim() != 2 or w.shape[1] % MX_BLOCK:
        raise ValueError(f"quant_mxfp8: expected a 2-D weight with K a multiple of 32, found "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    blocks = w.to(torch.float32).view(n, k // MX_BLOCK, MX_BLOCK)
    s = pow2_ceil(blocks.abs().amax(-1).clamp_min(1e-30) * _E4M3_MAX_INV)
    q = float_to_e4m3(blocks / s[..., None]).view(n, k)
    return q, float_to_e8m0(s)


# ------------------------------------------------------------------------------ run-time quant
def _blocks(x: Tensor, block: int, what: str) -> Tensor:
    if block <= 0 or x.shape[-1] % block:
        raise ValueError(f"{what}: the last dim ({x.shape[-1]}) must be a multiple of the block "
                         f"size ({block})")
    return x.to(torch.float32).unflatten(-1, (x.shape[-1] // block, block))


def act_quant(x: Tensor, block: int, scale_fmt: str | None = "ue8m0",
              scale_dtype: str | torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """FP8 activation quantization per ``block`` contiguous elements of the last dim.

    ``amax = max(|x|, 1e-4)``; ``s = 2^ceil(log2(amax/448))`` when ``scale_fmt`` is "ue8m0", else
    ``amax/448``; ``q = e4m3(clamp(x/s, ±448))`` (RNE).  Returns ``(q [..., K] float8_e4m3fn,
    s [..., K/block])`` with ``s`` in ``scale_dtype`` (float32 or e8m0, the latter only for
    power-of-two scales).
    """
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"act_quant: scale_fmt={scale_fmt!r} is not supported; allowed: "
                         "'ue8m0' or None")
    sdt = resolve_scale_dtype(scale_dtype)
    if sdt == torch.float8_e8m0fnu and scale_fmt is None:
        raise ValueError("act_quant: e8m0 scales need scale_fmt='ue8m0' (power-of-two scales)")
    xb = _blocks(x, block, "act_quant")
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(_FP8_AMAX_FLOOR)
    s = pow2_ceil(amax * _E4M3_MAX_INV) if scale_fmt else amax * _E4M3_MAX_INV
    q = float_to_e4m3(xb / s).flatten(-2)
    s = s.squeeze(-1)
    return q, (float_to_e8m0(s) if sdt == torch.float8_e8m0fnu else s)


def fake_quant_fp8(x: Tensor, block: int, scale_fmt: str | None = "ue8m0") -> Tensor:
    """``act_quant`` followed by dequantization: ``e4m3(clamp(x/s, ±448)) · s`` in x.dtype
    (the reference's in-place ``act_quant``)."""
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"fake_quant_fp8: scale_fmt={scale_fmt!r} is not supported; allowed: "
                         "'ue8m0' or None")
    xb = _blocks(x, block, "fake_quant_fp8")
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(_FP8_AMAX_FLOOR)
    s = pow2_ceil(amax * _E4M3_MAX_INV) if scale_fmt else amax * _E4M3_MAX_INV
    q = float_to_e4m3(xb / s).to(torch.float32)
    return (q * s).flatten(-2).to(x.dtype)


def fake_quant_fp4(x: Tensor, block: int = 32, scale_dtype: str = "e8m0") -> Tensor:
    """FP4 (e2m1) fake quantization per ``block`` elements of the last dim, in x.dtype.

    ``scale_dtype="e8m0"``: ``amax = max(|x|, 6·2^-126)``, ``s = 2^ceil(log2(amax/6))``;
    ``scale_dtype="e4m3"`` (V4.1 compressed KV): ``amax = max(|x|, 6·2^-9)``,
    ``s = e4m3(amax/6)``.  Then ``q = e2m1(clamp(x/s, ±6))`` (RNE, ties to even) and the
    result is ``q · s``.
    """
    xb = _blocks(x, block, "fake_quant_fp4")
    amax = xb.abs().amax(-1, keepdim=True)
    if scale_dtype in ("e8m0", "ue8m0"):
        s = pow2_ceil(amax.clamp_min(_FP4_AMAX_FLOOR_E8M0) * _E2M1_MAX_INV)
    elif scale_dtype == "e4m3":
        s = float_to_e4m3(amax.clamp_min(_FP4_AMAX_FLOOR_E4M3) * _E2M1_MAX_INV).to(torch.float32)
    else:
        raise ValueError(f"fake_quant_fp4: scale_dtype={scale_dtype!r} is not supported; "
                         "allowed: 'e8m0' or 'e4m3'")
    codes = e2m1_codes((xb / s).clamp(-E2M1_MAX, E2M1_MAX))
    q = _e2m1_table(x.device)[codes.to(torch.int64)]
    return (q * s).flatten(-2).to(x.dtype)


def hadamard_transform(x: Tensor) -> Tensor:
    """Normalized Walsh–Hadamard transform over the last dim (Sylvester order), scaled by
    ``dim^-0.5``; fp32 inside, x.dtype out.  The last dim must be a power of two."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_transform: the last dim must be a power of two, found {d}")
    y = x.to(torch.float32)
    h = 1
    while h < d:
        # Butterfly on pairs (i, i + h) inside each block of 2h: [a, b] -> [a + b, a − b].
        y = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * d ** -0.5).to(x.dtype)


# ------------------------------------------------------------------------------ QuantWeight
@dataclass
class QuantWeight:
    """A weight kept in its checkpoint format.

    ``weight``: float8_e4m3fn [N, K] for fmt "fp8" and "mxfp8"; int8 [N, K//2] packed e2m1 for
    "fp4".  ``scale``: e8m0 or float32 [ceil(N/B), ceil(K/B)] for "fp8"; e8m0 [N, K/32] for
    "fp4"/"mxfp8".  ``block``: B for "fp8", 32 otherwise.  ``shape``: the logical (N, K).
    """

    weight: Tensor
    scale: Tensor
    fmt: str
    block: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)  # type: ignore[assignment]
        if self.fmt not in FORMATS:
            raise ValueError(f"QuantWeight: fmt={self.fmt!r} is not supported; allowed: {FORMATS}")
        if len(self.shape) != 2:
            raise ValueError(f"QuantWeight: shape must be (N, K), found {self.shape}")
        n, k = self.shape
        if self.fmt == "fp4":
            want_w, want_s = (n, k // 2), (n, k // FP4_BLOCK)
            ok_dtype = self.weight.dtype in (torch.int8, torch.uint8)
        elif self.fmt == "mxfp8":
            want_w, want_s = (n, k), (n, k // MX_BLOCK)
            ok_dtype = self.weight.dtype == torch.float8_e4m3fn
        else:
            want_w, want_s = (n, k), (-(-n // self.block), -(-k // self.block))
            ok_dtype = self.weight.dtype == torch.float8_e4m3fn
        if not ok_dtype or tuple(self.weight.shape) != want_w:
            raise ValueError(f"QuantWeight({self.fmt}): weight {self.weight.dtype} "
                             f"{list(self.weight.shape)} does not fit logical shape "
                             f"{list(self.shape)}")
        if tuple(self.scale.shape) != want_s:
            raise ValueError(f"QuantWeight({self.fmt}): scale shape {list(self.scale.shape)}; "
                             f"expected {list(want_s)}")

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The dense [N, K] weight in ``dtype``."""
        if self.fmt == "fp4":
            return dequant_mxfp4(self.weight, self.scale, dtype)
        if self.fmt == "mxfp8":
            return dequant_mxfp8(self.weight, self.scale, dtype)
        return dequant_fp8_block(self.weight, self.scale, self.block, dtype)

    def to(self, device: torch.device | str) -> "QuantWeight":
        """A copy on ``device`` (same formats)."""
        return QuantWeight(self.weight.to(device), self.scale.to(device), self.fmt, self.block,
                           self.shape)

    @property
    def nbytes(self) -> int:
        return (self.weight.numel() * self.weight.element_size()
                + self.scale.numel() * self.scale.element_size())

