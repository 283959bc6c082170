"""Engram hash constants and the compressed token map (spec §4.7)."""

from __future__ import annotations

import time

import pytest

from dsv4.model.engram import build_compressed_token_map, engram_primes, is_prime


def test_primes_real_config_sums_and_start() -> None:
    t0 = time.perf_counter()
    primes = engram_primes([1, 14], 4, 8, 16_000_000)
    assert time.perf_counter() - t0 < 1.0
    assert [sum(sum(h) for h in layer) for layer in primes] == [384006168, 384016682]
    assert primes[0][0][:2] == [16000057, 16000079]
    flat = [p for layer in primes for size in layer for p in size]
    assert len(flat) == 48 and len(set(flat)) == 48
    assert all(is_prime(p) and p > 16_000_000 - 1 for p in flat)
    for layer in primes:
        assert len(layer) == 3
        for heads in layer:
            assert len(heads) == 8 and heads == sorted(heads)


def test_primes_small_by_hand() -> None:
    # size 2 of layer 0 takes 11, 13; size 3 restarts at 9 and skips the used ones; and so on.
    assert engram_primes([0, 1], 3, 2, 10) == [[[11, 13], [17, 19]], [[23, 29], [31, 37]]]


def test_is_prime_against_trial_division() -> None:
    def slow(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))
    assert [n for n in range(2000) if is_prime(n)] == [n for n in range(2000) if slow(n)]
    assert is_prime(2**61 - 1) and not is_prime(3215031751)  # a strong pseudoprime to 2,3,5,7


@pytest.mark.parametrize("bad", [dict(max_ngram_size=1), dict(n_heads=0), dict(vocab_size=0)])
def test_primes_bad_input(bad: dict) -> None:
    kw = dict(layer_ids=[1], max_ngram_size=3, n_heads=2, vocab_size=100) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        engram_primes(**kw)


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    def bl(text: str) -> str:  # the byte-level alphabet spelling of a text
        return "".join(s for s, _ in pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False).pre_tokenize_str(text))

    pieces = [
        "<s>",          # 0 special, kept verbatim
        "the",          # 1
        bl(" the"),     # 2 -> "the"
        "THE",          # 3 -> "the"
        bl(" "),        # 4 exactly one space: protected
        bl("  "),       # 5 collapses to one space
        bl("é")[0],     # 6 a lone UTF-8 lead byte: U+FFFD -> keyed by the raw token
        bl("é"),        # 7 -> "e" (accent stripped)
        "e",            # 8
        bl("\n"),       # 9 -> " "
        bl("\n "),      # 10 -> " "
        bl(" é"),       # 11 -> "e"
        ".",            # 12
        bl("\ufb01"),   # 13 ligature fi -> NFKC "fi"
        "fi",           # 14
        bl("\u0301"),   # 15 a combining accent alone normalizes to "": keyed by itself
        bl("é")[1],     # 16 a lone continuation byte: another U+FFFD key
    ]
    vocab = {p: i for i, p in enumerate(pieces)}
    assert len(vocab) == len(pieces)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>"])
    return tok


def test_compressed_token_map_by_hand() -> None:
    tok = _byte_level_tokenizer()
    token_map, size = build_compressed_token_map(tok)
    assert token_map == [0, 1, 1, 1, 2, 2, 3, 4, 4, 2, 2, 4, 5, 6, 6, 7, 8]
    assert size == 9


def test_compressed_token_map_accepts_transformers_fast_tokenizer() -> None:
    from transformers import PreTrainedTokenizerFast

    tok = _byte_level_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert build_compressed_token_map(fast) == build_compressed_token_map(tok)


def test_compressed_token_map_rejects_other_objects() -> None:
    with pytest.raises(ValueError, match="tokenizers.Tokenizer"):
        build_compressed_token_map(object())
