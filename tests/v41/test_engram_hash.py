"""Engram n-gram hashing (spec §4.7 "Hash ids"): hand-computed cases, a spec-literal oracle,
incremental-vs-full consistency, and the constants' invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dsv4.model.engram import (DEAD, NgramHasher, engram_offsets, engram_primes,
                               hash_multipliers, ngram_row_ids)


def test_multipliers_match_spec() -> None:
    mult = hash_multipliers([1, 14], 4, 99092)
    assert mult.dtype == np.int64
    assert mult.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    bound = (np.iinfo(np.int64).max // 99092) // 2
    assert np.all(mult % 2 == 1) and np.all(mult < 2 * bound + 1)
    # the bound keeps compressed_id * multiplier inside int64
    assert int(mult.max()) * 99091 < 2**63


def test_offsets_are_exclusive_prefix_sums() -> None:
    primes = engram_primes([1, 14], 4, 8, 16_000_000)
    offs = engram_offsets(primes)
    for layer, off in zip(primes, offs):
        flat = [p for size in layer for p in size]
        assert off[0] == 0 and len(off) == 24
        assert all(off[i + 1] - off[i] == flat[i] for i in range(23))
        assert off[-1] + flat[-1] == sum(flat)


# Tiny constants for hand computation: m = 3 (sizes 2, 3), 2 heads.
MULT = torch.tensor([[1, 2, 3]])
PRIMES = torch.tensor([[[7, 11], [13, 17]]])
OFFS = torch.tensor([[[0, 7], [18, 31]]])


def test_hash_by_hand_two_requests() -> None:
    # request 0 starts fresh and has an image token (DEAD) inside; request 1 continues
    # a sequence whose last two compressed ids were 1, 9.
    cids = torch.tensor([5, 3, DEAD, 4, 2, 6, 7])
    cu = torch.tensor([0, 4, 7])
    lookback = torch.tensor([[DEAD, DEAD], [1, 9]])
    rows, new_lb = ngram_row_ids(cids, cu, lookback, MULT, PRIMES, OFFS, pad_id=0)
    assert rows.shape == (7, 1, 4)
    assert rows[:, 0].tolist() == [
        [5, 12, 23, 36],   # toks [5, pad, pad]: 5 % 7, 5 % 11, 5 % 13, 5 % 17
        [2, 16, 27, 40],   # toks [3, 5, pad]: 3 ^ 10 = 9
        [0, 7, 18, 31],    # DEAD blocks itself: all pad
        [4, 11, 22, 35],   # previous token DEAD: toks [4, pad, pad]
        [2, 12, 24, 33],   # toks [2, 9, 1]: 2 ^ 18 = 16; 16 ^ 3 = 19
        [2, 9, 30, 39],    # toks [6, 2, 9]: 6 ^ 4 = 2; 2 ^ 27 = 25
        [4, 7, 18, 44],    # toks [7, 6, 2]: 7 ^ 12 = 11; 11 ^ 6 = 13
    ]
    assert new_lb.tolist() == [[DEAD, 4], [6, 7]]


def test_hash_by_hand_single_token_step_uses_lookback() -> None:
    rows, new_lb = ngram_row_ids(torch.tensor([7]), torch.tensor([0, 1]), torch.tensor([[2, 6]]),
                                 MULT, PRIMES, OFFS, pad_id=0)
    # lookback is oldest first: c_{t-2} = 2, c_{t-1} = 6, as for the last token above
    assert rows[0, 0].tolist() == [4, 7, 18, 44] and new_lb.tolist() == [[6, 7]]
    # a pad id other than 0 enters the products: toks [7, 5, 5] with the first lookback DEAD
    rows, _ = ngram_row_ids(torch.tensor([7]), torch.tensor([0, 1]), torch.tensor([[3, DEAD]]),
                            MULT, PRIMES, OFFS, pad_id=5)
    # p = [7, 10, 15]; 7 ^ 10 = 13; 13 ^ 15 = 2
    assert rows[0, 0].tolist() == [13 % 7, 7 + 13 % 11, 18 + 2, 31 + 2]


def spec_oracle(token_map: list[int], ids: list[int], mask: list[bool], pad_token: int,
                mult: np.ndarray, primes: list[list[list[int]]]) -> list[list[list[int]]]:
    """Spec §4.7 steps 1–4 literally, one whole sequence, Python integers."""
    c = [token_map[i] if ok else DEAD for i, ok in zip(ids, mask)]
    pad = token_map[pad_token]
    offs = engram_offsets(primes)
    m = mult.shape[1]
    out = []
    for t in range(len(ids)):
        blocked, tok = False, []
        for s in range(m):
            src = c[max(t - s, 0)]
            blocked = blocked or t < s or src == DEAD
            tok.append(pad if blocked else src)
        per_layer = []
        for li in range(len(primes)):
            p = [tok[s] * int(mult[li, s]) for s in range(m)]
            roll, cols = p[0], []
            for i in range(1, m):
                roll ^= p[i]
                cols += [roll % q for q in primes[li][i - 1]]
            per_layer.append([h + o for h, o in zip(cols, offs[li])])
        out.append(per_layer)
    return out


def _real_hasher(vocab: int = 50, compressed: int = 30, seed: int = 0) -> tuple[NgramHasher, list[int]]:
    rng = random.Random(seed)
    token_map = [rng.randrange(compressed) for _ in range(vocab)]
    token_map[:compressed] = list(range(compressed))  # every compressed id is used
    h = NgramHasher(token_map, [1, 14], 4, 8, 16_000_000, 99092, pad_token_id=2)
    return h, token_map


def _sequence(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[bool]]:
    ids = [rng.randrange(vocab) for _ in range(n)]
    mask = [True] * n
    start = rng.randrange(n)
    for k in range(start, min(n, start + rng.randrange(1, 4))):  # one image span
        mask[k] = False
    return ids, mask


def test_real_constants_match_spec_oracle() -> None:
    h, token_map = _real_hasher()
    rng = random.Random(1)
    ids, mask = _sequence(rng, 17, len(token_map))
    rows, lb = h(torch.tensor(ids), torch.tensor([0, 17]), h.fresh_lookback(1),
                 torch.tensor(mask))
    expect = spec_oracle(token_map, ids, mask, 2, h.multipliers.numpy(), h.primes_list)
    assert rows.tolist() == expect
    assert rows.shape == (17, 2, 24)
    assert lb.tolist() == [[token_map[i] if ok else DEAD for i, ok in zip(ids[-3:], mask[-3:])]]
    # every row lies inside its own (size, head) bucket of the layer's table
    offs = h.offsets.reshape(2, 24)
    assert torch.all(rows >= offs) and torch.all(rows < offs + h.primes.reshape(2, 24))
    assert [int(r) for r in (h.offsets.reshape(2, 24)[:, -1] + h.primes.reshape(2, 24)[:, -1])] \
        == h.num_rows == [384006168, 384016682]


def test_incremental_equals_full_in_mixed_batches() -> None:
    """Chunked prefill + decode of several requests, batched together with varying splits,
    gives the rows of one full pass per request."""
    h, token_map = _real_hasher(seed=3)
    rng = random.Random(7)
    seqs = [_sequence(rng, n, len(token_map)) for n in (13, 9, 6)]
    full = [h(torch.tensor(ids), torch.tensor([0, len(ids)]), h.fresh_lookback(1),
              torch.tensor(mask))[0] for ids, mask in seqs]
    # lookbacks live in a slot state, as in the cache
    state = torch.full((5, 3), 123, dtype=torch.int64)
    slots = [4, 0, 2]
    state[slots] = h.fresh_lookback(3)
    done = [0, 0, 0]
    got: list[list[torch.Tensor]] = [[], [], []]
    while any(d < len(s[0]) for d, s in zip(done, seqs)):
        active = [r for r in range(3) if done[r] < len(seqs[r][0])]
        ids, mask, cu = [], [], [0]
        takes = []
        for r in active:
            n = min(rng.choice([1, 1, 2, 3, 5]), len(seqs[r][0]) - done[r])
            takes.append(n)
            ids += seqs[r][0][done[r]:done[r] + n]
            mask += seqs[r][1][done[r]:done[r] + n]
            cu.append(cu[-1] + n)
        rows = h.step_slots(torch.tensor(ids), torch.tensor(cu), state,
                            torch.tensor([slots[r] for r in active]), torch.tensor(mask))
        for k, (r, n) in enumerate(zip(active, takes)):
            got[r].append(rows[cu[k]:cu[k + 1]])
            done[r] += n
    for r in range(3):
        assert torch.equal(torch.cat(got[r]), full[r])
    assert state[[1, 3]].eq(123).all()  # slots of nobody are untouched


def test_no_mask_means_all_text() -> None:
    h, token_map = _real_hasher()
    ids = torch.tensor([3, 4, 5, 6])
    a = h(ids, torch.tensor([0, 4]), h.fresh_lookback(1))[0]
    b = h(ids, torch.tensor([0, 4]), h.fresh_lookback(1), torch.ones(4, dtype=torch.bool))[0]
    assert torch.equal(a, b)


def test_hasher_errors(tiny_v41_cfg) -> None:
    h, token_map = _real_hasher()
    with pytest.raises(ValueError, match="input ids"):
        h.compressed_ids(torch.tensor([0, len(token_map)]))
    with pytest.raises(ValueError, match="lookback"):
        h(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="cu_seqlens"):
        h(torch.tensor([1, 2]), torch.tensor([0, 1, 2]), h.fresh_lookback(1))
    with pytest.raises(ValueError, match="token_map values"):
        NgramHasher([0, 5], [1], 3, 2, 100, 5, pad_token_id=0)
    cfg = tiny_v41_cfg
    tm = list(range(cfg.engram_compressed_vocab_size)) + [0] * (96 - 40)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher.from_config(cfg, tm, compressed_vocab_size=41)
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        NgramHasher.from_config(cfg.replace(engram_num_embeddings=(5, 6)), tm)
    ok = NgramHasher.from_config(cfg, tm, compressed_vocab_size=40)
    assert ok.num_rows == list(cfg.engram_num_embeddings)
