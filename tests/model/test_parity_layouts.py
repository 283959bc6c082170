"""Whole-model parity with transformers' DeepseekV4ForCausalLM on the two V4 layer schedules,
in numerics="bf16", float32, at every prompt length the foundation issue names.

Layouts (tiny, window 8, ratios 4 and 128, 5 layers + 1 MTP layer):

* V4-Flash: ``[0, 4, 128, 4, 128]`` (a sliding-window-only first layer);
* V4-Pro:   ``[128, 128, 4, 128, 4]`` (two HCA layers first, then CSA/HCA alternating).

Prompt lengths: 1; window−1, window, window+1 (7, 8, 9); multiples of 4 ± 1 (3, 5, 7, 9);
multiples of 128 ± 1 (127, 129, 255, 257); ≥ 3 windows (every length from 25 on).

transformers runs once per layout on the longest prompt: its model is causal, so the logits of
a prefix equal the first rows of the longer prompt's logits (checked directly on two lengths).
Ours runs ``forward_full`` on every length, and an incremental run (chunked prefill at odd split
points, then single-token decode steps across the window / group ends) on one cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.model.context import StepContext, pages_needed
from dsv4.model.transformer import Transformer, load_model
from test_parity_util import hf_modeling

ATOL = 1e-4  # logits have std ≈ 1; fp32 rounding differences are ~1e-5
LAYOUTS = {"flash": [0, 4, 128, 4, 128, 0], "pro": [128, 128, 4, 128, 4, 0]}
LENGTHS = [1, 3, 5, 7, 8, 9, 25, 127, 129, 255, 257]
MAX_LEN = max(LENGTHS)


@dataclass
class Pair:
    """Our model and transformers' on one checkpoint, with transformers' logits of ``ids``."""

    ours: Transformer
    theirs: Any
    ids: torch.Tensor      # [MAX_LEN] the prompt; shorter prompts are its prefixes
    ref: torch.Tensor      # [MAX_LEN, vocab] transformers' logits of ids


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    hf_modeling()
    from transformers import DeepseekV4ForCausalLM

    from dsv4.tiny import make_tiny_checkpoint

    layout = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{layout}"), variant="v4-bf16",
                                seed=3, compress_ratios=LAYOUTS[layout])
    ours = load_model(path, device="cpu", dtype=torch.float32, numerics="bf16")
    theirs, info = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    theirs.eval()
    # The schedule really is the layout's, on both sides (the lengths are chosen for it).
    cfg = ours.cfg
    assert list(cfg.compress_ratios[:cfg.n_layers]) == LAYOUTS[layout][:cfg.n_layers]
    expected_types = {0: "sliding_attention", 4: "compressed_sparse_attention",
                      128: "heavily_compressed_attention"}
    assert theirs.config.layer_types == [expected_types[r] for r in LAYOUTS[layout][:-1]]
    assert cfg.window_size == 8
    ids = torch.randint(2, cfg.vocab_size, (MAX_LEN,),
                        generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = theirs(ids[None], use_cache=False).logits[0]
    assert ref.std() > 0.5  # a meaningful comparison, not two near-zero tensors
    return Pair(ours, theirs, ids, ref)


def _assert_same_logits(logits: torch.Tensor, ref: torch.Tensor) -> None:
    assert logits.shape == ref.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL)
    same = logits.argmax(-1) == ref.argmax(-1)
    assert bool(same.all()), f"argmax differs at positions {torch.nonzero(~same).flatten()}"


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_logits_match(pair: Pair, length: int) -> None:
    _assert_same_logits(pair.ours.forward_full(pair.ids[:length]), pair.ref[:length])


@pytest.mark.parametrize("length", [9, 129])
def test_transformers_prefix_equals_its_own_forward(pair: Pair, length: int) -> None:
    """The shortcut above is sound: transformers on a prefix = the prefix rows of the long run."""
    with torch.no_grad():
        short = pair.theirs(pair.ids[None, :length], use_cache=False).logits[0]
    torch.testing.assert_close(short, pair.ref[:length], rtol=0, atol=1e-5)


# Chunk ends: odd prefill splits (inside a ratio-4 group, inside the window, just before a
# ratio-128 group closes), then single-token decode steps that close the groups ending at
# 127/255 and cross the window; a final multi-token chunk straddles position 256.
SPLITS = (2, 7, 30, 126, 127, 128, 129, 130, 133, 250, 254, 255, 256, 257)


def test_incremental_equals_full_and_transformers(pair: Pair) -> None:
    ours, ids = pair.ours, pair.ids
    assert SPLITS[-1] == MAX_LEN
    cache = HybridCache.allocate(ours.cfg, num_pages=pages_needed(MAX_LEN, 256), num_slots=1,
                                 page_size=256, dtype=ours.dtype, device="cpu")
    rows, start = [], 0
    for end in SPLITS:
        ctx = StepContext.single(ids[start:end], start_pos=start, all_logits=True)
        rows.append(ours.compute_logits(ours.forward(ctx, cache)))
        start = end
    incremental = torch.cat(rows)
    full = ours.forward_full(ids)
    # Same model, same math, only the cache path differs: fp32 rounding at most.
    torch.testing.assert_close(incremental, full, rtol=0, atol=ATOL)
    _assert_same_logits(incremental, pair.ref)
