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


def test_ints_to_device_and_host_derived_plans() -> None:
    """The index tensors now derived on the host (one packed copy) hold what the device
    formulas they replaced gave: request ids, the window ring's newest rows, entry plans."""
    import numpy as np

    from dsv4.model.attention import window_plan
    from dsv4.model.compressor import entry_plan
    from dsv4.model.context import ints_to_device

    a, b, c = ints_to_device([np.arange(3), np.zeros((2, 2), np.int32), [7]], "cpu")
    assert a.tolist() == [0, 1, 2] and b.shape == (2, 2) and b.dtype == torch.int64
    assert c.tolist() == [7] and ints_to_device([], "cpu") == []
    ctx = StepContext.build([1] * 9, seqlens=[2, 6, 1], start_pos=[0, 5, 3], slots=[2, 0, 1],
                            block_tables=[[3], [1, 4], [0]])
    assert ctx.request_of_token.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 2]
    assert ctx.logits_all is False and ctx.input_ids.dtype == torch.int64
    W = 4
    plan = window_plan(ctx, W, False)
    # The old formula: tokens whose position is within W of their request's end.
    req = ctx.request_of_token
    end = (ctx.start_pos + ctx.cu_seqlens[1:] - ctx.cu_seqlens[:-1])[req]
    keep = ctx.positions >= end - W
    assert torch.equal(plan["ring_tokens"], torch.nonzero(keep).squeeze(1))
    assert torch.equal(plan["ring_rows"], (ctx.slots[req] * W + ctx.positions % W)[keep])
    ep = entry_plan(ctx, 4)          # entries j with start <= 4j + 3 < end
    assert ep.request.tolist() == [1, 2] and ep.entry.tolist() == [1, 0]
    assert ep.counts_host == [0, 1, 1] and ep.start_entry_host == [0, 1, 0]
