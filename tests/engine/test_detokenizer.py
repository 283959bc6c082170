"""Incremental detokenization and stop strings with a small byte-level fake tokenizer."""

from __future__ import annotations

import pytest

from dsv4.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from dsv4.engine.sampling_params import SamplingParams


class ByteTokenizer:
    """ids 0/1 are special; the rest map to byte strings (some are half a UTF-8 character)."""

    SPECIAL = {0: b"<s>", 1: b"</s>"}

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = {**self.SPECIAL, **{i + 2: p for i, p in enumerate(pieces)}}
        self.ids = {p: i for i, p in self.pieces.items()}

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        data = b"".join(self.pieces[i] for i in ids
                        if not (skip_special_tokens and i in self.SPECIAL))
        return data.decode("utf-8", errors="replace")

    def encode(self, *pieces: bytes) -> list[int]:
        return [self.ids[p] for p in pieces]


TOK = ByteTokenizer([b"Hello", b" world", b"\xc3", b"\xa9", b"!", b" STOP", b"ST", b"OP", b" x"])


def stream(ids: list[int], **kw) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    det = IncrementalDetokenizer(TOK, TOK.encode(b"Hello"), SamplingParams(**kw))
    shown, hit = [], None
    for t in ids:
        hit = det.add_token(t)
        shown.append(det.visible_text(finished=hit is not None))
        if hit:
            break
    return det, shown, hit


def test_incremental_text_equals_full_decode_and_waits_for_split_characters() -> None:
    ids = TOK.encode(b" world", b"\xc3", b"\xa9", b"!", b" x")
    det, shown, hit = stream(ids)
    assert hit is None
    assert det.text == TOK.decode(ids) == " world\u00e9! x"
    assert "\ufffd" not in "".join(shown)
    assert shown[1] == shown[0]  # half of "é" shows nothing yet


def test_special_tokens_are_skipped_or_kept() -> None:
    ids = [0] + TOK.encode(b"!") + [1]
    assert stream(ids)[0].text == "!"
    assert stream(ids, skip_special_tokens=False)[0].text == "<s>!</s>"


def test_stop_string_is_cut_and_never_shown_even_when_split() -> None:
    ids = TOK.encode(b"!", b" x", b"ST", b"OP", b" x")
    det, shown, hit = stream(ids, stop="STOP")
    assert hit == "STOP" and det.text == "! x"
    # "ST" was held back while it could still become "STOP".
    assert all(not s.endswith("S") and "ST" not in s for s in shown)
    assert shown == ["", "", "! ", "! x"]  # 3 = len("STOP") - 1 characters held back
    det, _, hit = stream(ids, stop=["OP x", "STOP"], include_stop_str_in_output=True)
    assert hit == "STOP" and det.text == "! xSTOP"


def test_earliest_stop_string_wins() -> None:
    det, _, hit = stream(TOK.encode(b" world", b" STOP"), stop=["STOP", "world"])
    assert hit == "world" and det.text == " "


def test_suppressed_token_adds_no_text() -> None:
    det = IncrementalDetokenizer(TOK, [], SamplingParams())
    det.add_token(TOK.encode(b"!")[0])
    det.add_token(TOK.encode(b" x")[0], suppress_text=True)
    assert det.text == "!"


def test_visible_text_holds_back_only_with_stop_strings() -> None:
    det, shown, _ = stream(TOK.encode(b"!", b" world"))
    assert shown == ["!", "! world"]
    det, shown, _ = stream(TOK.encode(b"!", b" world"), stop=["abc"])
    assert shown == ["", "! wor"] and det.visible_text(finished=True) == "! world"


def test_token_text_cache() -> None:
    cache = TokenTextCache(TOK)
    assert cache(1) == "</s>" and cache(TOK.encode(b" x")[0]) == " x"


@pytest.mark.parametrize("bad", [[""], [3]])
def test_bad_stop_strings_rejected(bad: list) -> None:
    with pytest.raises(ValueError, match=r"stop\[0\]"):
        SamplingParams(stop=bad)


def test_flush_emits_an_incomplete_character_at_the_end() -> None:
    det = IncrementalDetokenizer(TOK, [], SamplingParams(stop=["\ufffd!"]))
    det.add_token(TOK.encode(b"!")[0])
    det.add_token(TOK.encode(b"\xc3")[0])
    assert det.text == "!"
    assert det.flush() is None and det.text == "!\ufffd"
    assert det.flush() is None and det.text == "!\ufffd"
    det = IncrementalDetokenizer(TOK, [], SamplingParams(stop=["\ufffd"]))
    det.add_token(TOK.encode(b"\xc3")[0])
    assert det.flush() == "\ufffd" and det.text == ""
