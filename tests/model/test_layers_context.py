"""StepContext construction, helpers and validation."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.context import StepContext, pages_needed


def test_single_request_context() -> None:
    ctx = StepContext.single([5, 6, 7], start_pos=254, page_size=128)
    assert ctx.positions.tolist() == [254, 255, 256]
    assert ctx.cu_seqlens.tolist() == [0, 3]
    assert ctx.start_pos.tolist() == [254] and ctx.slots.tolist() == [0]
    assert ctx.block_tables.tolist() == [[0, 1, 2]]      # 257 tokens need 3 pages of 128
    assert ctx.logits_indices.tolist() == [0, 1, 2]
    assert ctx.end_pos_host == [257]
    last = StepContext.single(torch.tensor([1, 2]), all_logits=False)
    assert last.logits_indices.tolist() == [1]
    assert last.block_tables.tolist() == [[0]]


def test_batched_context_helpers() -> None:
    ctx = StepContext.build([1, 2, 3, 4, 5, 6], seqlens=[2, 1, 3], start_pos=[0, 9, 4],
                            slots=[2, 0, 1], block_tables=[[3], [1, 4], [0]])
    assert ctx.positions.tolist() == [0, 1, 9, 4, 5, 6]
    assert ctx.request_of_token.tolist() == [0, 0, 1, 2, 2, 2]
    assert ctx.block_tables.tolist() == [[3, -1], [1, 4], [0, -1]]
    assert ctx.logits_indices.tolist() == [1, 2, 5]
    assert ctx.cu_seqlens_host == [0, 2, 3, 6]
    assert ctx.token_range(2) == (3, 6)
    assert ctx.slots_host == [2, 0, 1] and not ctx.is_decode
    assert StepContext.build([1, 2], [1, 1], [3, 8], [0, 1], [[0], [1]]).is_decode
    assert pages_needed(256, 256) == 1 and pages_needed(257, 256) == 2


def test_context_rejects_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="seqlens_host"):
        StepContext.build([1, 2, 3], [2], [0], [0], [[0]])
    with pytest.raises(ValueError, match="one entry per request"):
        StepContext.build([1, 2], [1, 1], [0], [0, 1], [[0], [1]])
    with pytest.raises(ValueError, match=">= 1 token"):
        StepContext.build([1, 2], [2, 0], [0, 0], [0, 1], [[0], [1]])
    with pytest.raises(ValueError, match="non-empty"):
        StepContext.single([])
    with pytest.raises(ValueError, match="token_types"):
        StepContext.single([1, 2], token_types=[-1])
    ok = StepContext.single([1, 2], token_types=[-1, 0])
    assert ok.token_types.tolist() == [-1, 0]
