"""GPU side of the streamed load (skipped without CUDA): the device peak of ``load_model`` is the
model plus one tensor (measured by the caching allocator), and the bf16 head's logits come from
``torch.mm(..., out_dtype=torch.float32)`` with the fp32 values of the bf16 products."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dsv4.checkpoint import expected_tensors
from dsv4.config import ModelConfig
from dsv4.model.transformer import load_model
from dsv4.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_cuda_load_peaks_at_model_plus_one_tensor(tmp_path, variant: str) -> None:
    path = str(make_tiny_checkpoint(tmp_path / variant, variant=variant, seed=3))
    cfg = ModelConfig.from_file(path)
    dev = torch.device("cuda")
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model = load_model(path, device=dev)
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev) - base
    peak = torch.cuda.max_memory_allocated(dev) - base
    # One tensor in flight, with its conversion temporaries (fp32 dequantization of wo_a,
    # bf16 -> fp32 widening): at most 8 bytes per element of the largest tensor.
    largest = max(math.prod(s.shape) for s in expected_tensors(cfg).values())
    assert peak <= held + 8 * largest + (1 << 20), (peak, held, largest)
    # The old path (storage first, every tensor read before the copies) needs about twice.
    assert held > 8 * largest
    assert all(p.is_cuda for p in model.parameters())
    assert model.head.weight.dtype == torch.bfloat16
    if cfg.is_v41:
        table = model.layers[cfg.engram_layer_ids[0]].engram.embed
        assert table.weight.is_cuda and table.weight.dtype == torch.float8_e4m3fn


def test_cuda_bf16_head_gives_fp32_logits(tmp_path) -> None:
    path = str(make_tiny_checkpoint(tmp_path / "v4", variant="v4", seed=3))
    model = load_model(path, device="cuda")
    w = model.head.weight
    assert w.dtype == torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(5, model.cfg.dim, device="cuda", generator=gen).to(torch.bfloat16)
    logits = model.compute_logits(hidden)  # the torch.mm(..., out_dtype=fp32) path
    assert logits.dtype == torch.float32 and logits.shape == (5, model.cfg.vocab_size)
    ref = hidden.double() @ w.double().T
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, F.linear(hidden.float(), w.float()), rtol=1e-5, atol=1e-5)
    # fp32 hidden states take the exact chunked path
    h32 = torch.randn(3, model.cfg.dim, device="cuda", generator=gen)
    torch.testing.assert_close(model.compute_logits(h32).double(), h32.double() @ w.double().T,
                               rtol=1e-5, atol=1e-5)
