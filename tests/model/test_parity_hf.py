"""Whole-model parity with transformers' DeepseekV4ForCausalLM on a tiny bf16 checkpoint in
float32: same logits (fp32 rounding) for prompts crossing the window (8), ratio-4 and ratio-128
boundaries, and the same greedy continuation, our decode running incrementally on the cache.

transformers reads the checkpoint as written (official names through its conversion mapping,
the official config.json keys; MTP tensors ignored), so nothing is converted for it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.model.context import StepContext, pages_needed
from dsv4.model.transformer import Transformer, load_model
from test_parity_util import hf_modeling

ATOL = 1e-4  # logits have std ≈ 1; fp32 rounding differences are ~1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, Any]:
    hf_modeling()
    from transformers import DeepseekV4ForCausalLM

    from dsv4.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v4_bf16"), variant="v4-bf16")
    ours = load_model(path, device="cpu", dtype=torch.float32)
    theirs, info = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # The lengths below are chosen for this schedule: window 8, CSA (4) and HCA (128) layers.
    assert ours.cfg.window_size == 8 and {4, 128} <= set(ours.cfg.compress_ratios)
    return ours, theirs.eval()


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [1, 5, 37, 300])
def test_prefill_logits_match(models: tuple[Transformer, Any], length: int) -> None:
    ours, theirs = models
    cfg = ours.cfg
    ids = _prompt(length, cfg.vocab_size, length)
    logits = ours.forward_full(ids)
    with torch.no_grad():
        ref = theirs(ids[None], use_cache=False).logits[0]
    assert logits.shape == (length, cfg.vocab_size) and logits.dtype == torch.float32
    assert ref.std() > 0.5  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL)


def _greedy_incremental(model: Transformer, prompt: torch.Tensor, steps: int
                        ) -> tuple[list[int], torch.Tensor]:
    """Prefill then one token per step on one cache; returns tokens and per-step logits."""
    total = prompt.numel() + steps
    cache = HybridCache.allocate(model.cfg, num_pages=pages_needed(total, 256), num_slots=1,
                                 page_size=256, dtype=model.dtype, device="cpu")
    ctx = StepContext.single(prompt, start_pos=0, all_logits=False)
    logits = model.compute_logits(model.forward(ctx, cache))
    tokens, rows = [], []
    pos = prompt.numel()
    for _ in range(steps):
        rows.append(logits[-1])
        tok = int(logits[-1].argmax())
        tokens.append(tok)
        ctx = StepContext.single(torch.tensor([tok]), start_pos=pos, all_logits=False)
        logits = model.compute_logits(model.forward(ctx, cache))
        pos += 1
    return tokens, torch.stack(rows)


def test_greedy_decode_matches(models: tuple[Transformer, Any]) -> None:
    """20 greedy tokens from position 243: the decode crosses ratio-4 groups, the window and
    the end of the second ratio-128 group (position 255)."""
    ours, theirs = models
    prompt = _prompt(243, ours.cfg.vocab_size, 7)
    tokens, step_logits = _greedy_incremental(ours, prompt, 20)
    from transformers import GenerationConfig

    greedy = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)  # no EOS: always 20 tokens, argmax untouched
    with torch.no_grad():
        out = theirs.generate(prompt[None], generation_config=greedy)
    assert tokens == out[0, prompt.numel():].tolist()
    # And each decode step's logits equal transformers' full forward of the final sequence.
    full = torch.cat([prompt, torch.tensor(tokens)])
    with torch.no_grad():
        ref = theirs(full[None], use_cache=False).logits[0]
    torch.testing.assert_close(step_logits, ref[prompt.numel() - 1:-1], rtol=0, atol=ATOL)
