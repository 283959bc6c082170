"""The FP8 block GEMM twin (spec §2.5): activation quantization fused, fp32 accumulation over
K blocks, e8m0 or float32 weight scales."""

from __future__ import annotations

import pytest
import torch

from dsv4.formats import act_quant, e8m0_to_float, quant_fp8_block
from dsv4.ops import get_ops
from dsv4.ops import torch_dense as td


def _blockwise_reference(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                         block: int) -> torch.Tensor:
    """Σ over K blocks of (x8·sx)(W8·sW)^T, spelled out block by block in float64."""
    q, sx = act_quant(x, block)
    sw = w_scale.float() if w_scale.dtype == torch.float32 else e8m0_to_float(w_scale)
    n, k = w8.shape
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for kb in range(k // block):
        cols = slice(kb * block, (kb + 1) * block)
        xa = q[:, cols].double() * sx[:, kb:kb + 1].double()
        for nb in range(-(-n // block)):
            rows = slice(nb * block, min((nb + 1) * block, n))
            wb = w8[rows, cols].double() * sw[nb, kb].double()
            y[:, rows] += xa @ wb.T
    return y


@pytest.mark.parametrize("scale_dtype", ["e8m0", "fp32"])
@pytest.mark.parametrize("block", [32, 128])
def test_fp8_linear_equals_blockwise_sum(block: int, scale_dtype: str) -> None:
    g = torch.Generator().manual_seed(block)
    n, k = 3 * block + 8, 2 * block  # a partial last row block
    w = torch.randn(n, k, generator=g) * 0.1
    w8, w_scale = quant_fp8_block(w, block, scale_dtype)
    x = torch.randn(5, k, generator=g) * torch.logspace(-3, 2, k)  # blocks of very different range
    y = td.fp8_linear(x.bfloat16(), w8, w_scale, block, torch.float32)
    ref = _blockwise_reference(x.bfloat16(), w8, w_scale, block)
    assert y.dtype == torch.float32 and y.shape == (5, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    # The activation really is quantized: an unquantized GEMM gives something else.
    dense = x.bfloat16().double() @ td.dequant_fp8_block(w8, w_scale, block, torch.float64).T
    assert (dense - ref).abs().max() > 1e-3
    assert get_ops("torch").fp8_linear is td.fp8_linear
    assert td.fp8_linear(x, w8, w_scale, block, torch.bfloat16).dtype == torch.bfloat16


def test_fp8_linear_rejects_mismatched_shapes() -> None:
    w8, w_scale = quant_fp8_block(torch.randn(64, 128), 128, "e8m0")
    with pytest.raises(ValueError, match="fp8_linear: x has 96 input features"):
        td.fp8_linear(torch.randn(2, 96), w8, w_scale, 128, torch.float32)
    with pytest.raises(ValueError, match="scale"):
        td.fp8_linear(torch.randn(2, 128), w8, w_scale[:, :0], 128, torch.float32)
