"""Helpers shared by the V4.1 model tests: one tiny V4.1 checkpoint per session, loaded models,
step runners and a hook that records what each layer attended to; plus checks of the helpers.

The tiny V4.1 model (dsv4.tiny, variant "v41"): 8 layers with ratios [0,0,2,2,1,1,1,1], KV
sources [2, 4], index sources [2, 4, 6], candidate source 4 (2 blocks of 2 entries), index_topk
4, window 8, Engram at layers 1 and 3, 2 DSpark stages.
"""

from __future__ import annotations

import functools
import os
import tempfile
from types import SimpleNamespace
from typing import Any, Sequence

import pytest
import torch

from dsv4.cache.tensors import HybridCache
from dsv4.model.context import StepContext
from dsv4.model.transformer import Transformer, load_model
from dsv4.tiny import make_tiny_checkpoint

PAGE = 16      # several pages per request: exercises the block tables of every pool
WINDOW = 8
S = 30         # crosses the window, many ratio-2 groups, > index_topk and > candidate entries
SWA, FULL2, REUSE2, FULL1, REUSE1, REINDEX, REUSE_RI = 0, 2, 3, 4, 5, 6, 7

# Removed at interpreter exit.
_TMP = tempfile.TemporaryDirectory(prefix="dsv4-v41-tests-")


@functools.lru_cache(maxsize=None)
def v41_checkpoint() -> str:
    """Path of the session's tiny V4.1 checkpoint (seed 0)."""
    return make_tiny_checkpoint(os.path.join(_TMP.name, "v41"), variant="v41", seed=0)


@functools.lru_cache(maxsize=None)
def v41_model(numerics: str = "bf16") -> Transformer:
    """A shared loaded model (float32); tests that change parameters load their own."""
    return load_model(v41_checkpoint(), dtype=torch.float32, numerics=numerics)


def prompt(seed: int, n: int = S, vocab: int = 500) -> torch.Tensor:
    """Random token ids in 3..vocab−1 (no BOS/EOS/PAD)."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def new_cache(model: Transformer, num_pages: int = 8, num_slots: int = 4) -> HybridCache:
    return HybridCache.allocate(model.cfg, num_pages, num_slots, PAGE, torch.float32)


def run_chunks(model: Transformer, ids: torch.Tensor, sizes: Sequence[int],
               cache: HybridCache | None = None, slot: int = 0,
               pages: Sequence[int] | None = None,
               token_types: torch.Tensor | None = None) -> torch.Tensor:
    """Feed one request in chunks of ``sizes`` (the last size repeats); logits [S, vocab]."""
    cache = cache if cache is not None else new_cache(model)
    pages = list(range(cache.num_pages)) if pages is None else list(pages)
    outs, pos, k = [], 0, 0
    while pos < ids.shape[0]:
        n = min(sizes[min(k, len(sizes) - 1)], ids.shape[0] - pos)
        tt = None if token_types is None else token_types[pos:pos + n]
        ctx = StepContext.build(ids[pos:pos + n], [n], [pos], [slot], [pages],
                                logits_indices=list(range(n)), token_types=tt)
        outs.append(model.compute_logits(model.forward(ctx, cache)))
        pos, k = pos + n, k + 1
    return torch.cat(outs)


class AttendRecorder:
    """Wraps every attention layer's ``sparse_attn`` op to record (kv_b, idx_b) per layer.

    Use as a context manager; ``calls[layer]`` lists the (kv_b, idx_b) of each call.
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.calls: dict[int, list[tuple[Any, Any]]] = {}
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> "AttendRecorder":
        for layer in self.model.layers:
            att = layer.attn
            ops = att.ops
            table = dict(vars(ops))

            def sparse_attn(q, kv_a, idx_a, kv_b, idx_b, sink, scale, *a, _l=att.layer_id,
                            _op=ops.sparse_attn, **kw):
                self.calls.setdefault(_l, []).append(
                    (kv_b, None if idx_b is None else idx_b.clone()))
                return _op(q, kv_a, idx_a, kv_b, idx_b, sink, scale, *a, **kw)

            table["sparse_attn"] = sparse_attn
            self._saved.append((att, ops))
            att.ops = SimpleNamespace(**table)
        return self

    def __exit__(self, *exc: Any) -> None:
        for att, ops in self._saved:
            att.ops = ops
        self._saved.clear()


# ------------------------------------------------------------------ checks of the helpers
pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_v41_schedule_is_what_the_tests_assume() -> None:
    cfg = v41_model().cfg
    assert cfg.is_v41 and cfg.window_size == WINDOW and cfg.index_topk == 4
    modes = [cfg.attn_mode(i) for i in range(cfg.n_layers)]
    assert modes == ["swa", "swa", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert cfg.candidate_source_layer == FULL1 and cfg.uses_candidates(REINDEX)
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size == cfg.index_topk
    assert cfg.engram_layer_ids == (1, 3) and cfg.n_mtp_layers == 2


def test_recorder_restores_the_ops() -> None:
    model = v41_model()
    before = [layer.attn.ops for layer in model.layers]
    with AttendRecorder(model) as rec:
        run_chunks(model, prompt(0, 5), [5])
    assert [layer.attn.ops for layer in model.layers] == before
    assert sorted(rec.calls) == list(range(model.cfg.n_layers))
    assert rec.calls[SWA][0][0] is None and rec.calls[FULL2][0][1].shape[0] == 5
