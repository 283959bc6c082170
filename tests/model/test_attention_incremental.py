"""Incremental consistency of one attention layer on the paged hybrid cache.

A one-shot prefill, chunked prefills at odd split points, prefill + token-by-token decode and
interleaved batched requests must agree (fp32 compute, "bf16" numerics: to fp32 rounding; the
compressed entries bit for bit).  "official" numerics is discontinuous (FP8/FP4 rounding), so it
is checked statistically (spec §6.13).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.model.context import StepContext
from test_attention_helpers import (LAYER_CSA, LAYER_HCA, LAYER_SWA, PAGE, WINDOW,
                                    make_attention, new_cache, run_chunks)

S = 300  # crosses the window, many ratio-4 groups and two ratio-128 groups
TOL = dict(rtol=0, atol=2e-5)
POOL = dict(rtol=0, atol=2e-5)   # fp32 rounding: GEMMs may differ by batch size


def _inputs(seed: int, n: int = S) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def layers() -> dict:
    """Per layer: the module, its input and the one-shot prefill (output + cache)."""
    out = {}
    for layer in (LAYER_SWA, LAYER_CSA, LAYER_HCA):
        att = make_attention(layer, seed=10 + layer)
        x = _inputs(layer)
        cache = new_cache(att)
        ref = run_chunks(att, x, [S], cache)
        out[layer] = (att, x, ref, cache)
    return out


ALL = [LAYER_SWA, LAYER_CSA, LAYER_HCA]


@pytest.mark.parametrize("layer", ALL)
@pytest.mark.parametrize("sizes", [[7], [13], [WINDOW - 1], [WINDOW + 1], [1, 130, 5, 64]],
                         ids=["7", "13", "W-1", "W+1", "1-130-5-64"])
def test_chunked_prefill_matches_one_shot(layers, layer, sizes) -> None:
    att, x, ref, ref_cache = layers[layer]
    cache = new_cache(att)
    out = run_chunks(att, x, sizes, cache)
    torch.testing.assert_close(out, ref, **TOL)
    # (bit-identity of the pooling itself: test_attention_compressor.py, with exact inputs)
    if layer != LAYER_SWA:
        torch.testing.assert_close(cache.compressed[layer], ref_cache.compressed[layer], **POOL)
    if layer == LAYER_CSA:
        torch.testing.assert_close(cache.index_keys[layer], ref_cache.index_keys[layer], **POOL)


@pytest.mark.parametrize("layer", ALL)
def test_prefill_then_decode_matches_one_shot(layers, layer) -> None:
    att, x, ref, ref_cache = layers[layer]
    cache = new_cache(att)
    n0 = 131  # ends mid-group for both ratios
    out = run_chunks(att, x, [n0] + [1] * (S - n0), cache)
    torch.testing.assert_close(out, ref, **TOL)
    if layer != LAYER_SWA:
        torch.testing.assert_close(cache.compressed[layer], ref_cache.compressed[layer], **POOL)


@pytest.mark.parametrize("layer", [LAYER_CSA, LAYER_HCA])
def test_chunked_outputs_differ_from_a_wrong_cache(layers, layer) -> None:
    """Guard against a vacuous comparison: dropping the carry-over state must change outputs."""
    att, x, ref, _ = layers[layer]
    cache = new_cache(att)
    run_chunks(att, x[:150], [150], cache)
    cache.reset_slots([0])  # forget window + compressor rows of the request
    ctx = StepContext.build(torch.zeros(150, dtype=torch.long), [150], [150], [0],
                            [list(range(cache.num_pages))])
    out = att(x[150:], ctx, cache)
    assert (out - ref[150:]).abs().max() > 1e-3


def test_interleaved_requests_share_pools(layers) -> None:
    """Two requests with different slots and non-contiguous pages, batched in mixed steps
    (prefill chunks together with decode tokens), equal their one-shot runs."""
    for layer in ALL:
        att, xa, ref_a, _ = layers[layer]
        xb = _inputs(100 + layer, 260)
        ref_b = run_chunks(att, xb, [260], new_cache(att))
        cache = new_cache(att, num_pages=8, num_slots=4)
        pages = {0: [5, 1, 6], 1: [2, 7, 0]}          # request -> its pages
        slots = {0: 3, 1: 1}
        xs, done, outs = {0: xa, 1: xb}, {0: 0, 1: 0}, {0: [], 1: []}
        schedule = [(37, 0), (5, 60), (1, 1), (100, 1), (1, 1), (1, 13), (200, 1), (1, 1),
                    (1, 170), (1, 1)]
        k = 0
        while done[0] < S or done[1] < 260:
            plan = schedule[min(k, len(schedule) - 1)]
            k += 1
            reqs = [r for r in (0, 1) if min(plan[r], xs[r].shape[0] - done[r]) > 0]
            sizes = [min(plan[r], xs[r].shape[0] - done[r]) for r in reqs]
            if not reqs:
                continue
            x = torch.cat([xs[r][done[r]:done[r] + n] for r, n in zip(reqs, sizes)])
            ctx = StepContext.build(torch.zeros(sum(sizes), dtype=torch.long), sizes,
                                    [done[r] for r in reqs], [slots[r] for r in reqs],
                                    [pages[r] for r in reqs])
            y = att(x, ctx, cache)
            off = 0
            for r, n in zip(reqs, sizes):
                outs[r].append(y[off:off + n])
                off += n
                done[r] += n
        torch.testing.assert_close(torch.cat(outs[0]), ref_a, **TOL)
        torch.testing.assert_close(torch.cat(outs[1]), ref_b, **TOL)


def test_batched_decode_of_many_requests() -> None:
    """A decode step over several requests (ring path) equals each request decoded alone."""
    att = make_attention(LAYER_CSA, seed=3)
    lens = [5, 19, 40]
    xs = [_inputs(200 + i, n + 1) for i, n in enumerate(lens)]
    solo = []
    for i, x in enumerate(xs):
        c = new_cache(att)
        solo.append(run_chunks(att, x, [lens[i], 1], c)[-1])
    cache = new_cache(att, num_pages=6, num_slots=3)
    pages = [[0, 3], [1, 4], [2, 5]]
    for i, x in enumerate(xs):
        ctx = StepContext.build(torch.zeros(lens[i], dtype=torch.long), [lens[i]], [0], [i],
                                [pages[i]])
        att(x[:lens[i]], ctx, cache)
    ctx = StepContext.build(torch.zeros(3, dtype=torch.long), [1, 1, 1], lens, [0, 1, 2], pages)
    assert ctx.is_decode
    y = att(torch.stack([x[-1] for x in xs]), ctx, cache)
    torch.testing.assert_close(y, torch.stack(solo), **TOL)


@pytest.mark.parametrize("layer", ALL)
def test_official_numerics_mostly_bit_identical(layer) -> None:
    """With FP8/FP4 fake quantization on, chunked and one-shot runs agree exactly on most
    outputs (a rounding-boundary flip may spread; spec §6.13) and stay close overall."""
    pytest.importorskip("dsv4.formats")
    att = make_attention(layer, numerics="official", seed=20 + layer)
    x = _inputs(50 + layer, 200)
    ref = run_chunks(att, x, [200], new_cache(att))
    out = run_chunks(att, x, [29, 1, 1, 7, 100, 1], new_cache(att))
    close = torch.isclose(out, ref, rtol=0, atol=1e-5).float().mean().item()
    assert close > 0.9, close
    assert (out - ref).abs().max() < 0.2 * ref.abs().max()
    # and official numerics really differ from bf16 numerics
    plain = make_attention(layer, numerics="bf16", seed=20 + layer)
    assert not torch.allclose(run_chunks(plain, x, [200], new_cache(plain)), ref, atol=1e-4)
