"""The attention layer on a CUDA device (skipped without one): the same step logic as on the
CPU, chunked = one-shot on the device, and a bf16 run that stays close to fp32."""

from __future__ import annotations

import pytest
import torch

from test_attention_helpers import (LAYER_CSA, LAYER_HCA, LAYER_SWA, make_attention, new_cache,
                                    run_chunks)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("layer", [LAYER_SWA, LAYER_CSA, LAYER_HCA])
@pytest.mark.parametrize("numerics", ["bf16", "official"])
def test_cuda_matches_cpu_and_is_incremental(layer: int, numerics: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    att = make_attention(layer, numerics=numerics, seed=60 + layer)
    x = torch.randn(300, att.cfg.dim, generator=torch.Generator().manual_seed(layer))
    cpu = run_chunks(att, x, [300], new_cache(att))
    att = att.cuda()
    xg = x.cuda()
    one = run_chunks(att, xg, [300], new_cache(att))
    steps = run_chunks(att, xg, [37, 1, 1, 9, 130, 1, 1], new_cache(att))
    if numerics == "bf16":
        torch.testing.assert_close(one.cpu(), cpu, rtol=0, atol=5e-4)
        torch.testing.assert_close(steps, one, rtol=0, atol=5e-4)
    else:  # discontinuous: a statistical check
        assert torch.isclose(one.cpu(), cpu, rtol=0, atol=5e-4).float().mean() > 0.9
        assert torch.isclose(steps, one, rtol=0, atol=5e-4).float().mean() > 0.9


@pytest.mark.parametrize("layer", [LAYER_CSA, LAYER_HCA])
def test_cuda_bf16_compute_close_to_fp32(layer: int) -> None:
    ref = make_attention(layer, seed=70 + layer).cuda()
    low = make_attention(layer, seed=70 + layer, dtype=torch.bfloat16).cuda()
    x = torch.randn(300, ref.cfg.dim, generator=torch.Generator().manual_seed(layer)).cuda()
    want = run_chunks(ref, x, [300], new_cache(ref))
    got = run_chunks(low, x.bfloat16(), [100, 1, 1, 198], new_cache(low))
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs().mean() / want.abs().mean()
    assert err < 0.05, err
