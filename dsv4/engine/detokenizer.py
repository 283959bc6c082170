"""Incremental detokenization and stop strings.

Text is produced one token at a time by decoding a short window of ids (a few tokens of context
plus the new ones) and keeping only the part that is new; a piece that ends in U+FFFD (an
incomplete UTF-8 sequence split over tokens) waits for the next token.  The context (the tail of
the prompt, then of the output) makes the leading spaces of word-piece tokenizers come out right.

Stop strings are searched in the text; the match and everything after it are cut (kept with
``include_stop_str_in_output``).  While a sequence runs, the last ``len(longest stop) - 1``
characters are held back from the visible text so that a stop string split over steps never
shows up in streamed output and then disappears.
"""

from __future__ import annotations

from typing import Any, Protocol

from dsv4.engine.sampling_params import SamplingParams

# Prompt tokens used as decoding context for the first generated tokens.
_CONTEXT_TOKENS = 6


class TokenizerLike(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kw: Any) -> str: ...


def decode_ids(tokenizer: TokenizerLike, ids: list[int], skip_special_tokens: bool) -> str:
    """Decode without transformers' clean-up pass (it would not commute with incremental use)."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    except TypeError:  # a minimal tokenizer without that keyword
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a sequence's generated ids into text, one token at a time, and finds stop strings.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        prompt_token_ids: the prompt (its tail is decoding context only, never output text).
        params: gives ``skip_special_tokens``, ``stop`` and ``include_stop_str_in_output``.
    """

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # all text decoded so far (cut at a stop string once one matched)
        self._hold = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self.finished = False

    def add_token(self, token_id: int, *, suppress_text: bool = False) -> str | None:
        """Add one generated id; returns the stop string it completed, if any.

        ``suppress_text`` drops the token's own text (an eos or stop token id that ends the
        sequence, unless the user asked to include stop strings).
        """
        if self.finished or suppress_text:
            return None
        self._ids.append(int(token_id))
        prefix = decode_ids(self.tokenizer, self._ids[self._prefix_offset:self._read_offset],
                            self.skip_special_tokens)
        full = decode_ids(self.tokenizer, self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing new yet, or an incomplete character
        new_text = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += new_text
        return self._find_stop(old_len)

    def flush(self) -> str | None:
        """At the end of a sequence: add the text still held back as incomplete (it decodes
        with U+FFFD); returns a stop string it completed, if any."""
        if self.finished or self._read_offset >= len(self._ids):
            return None
        prefix = decode_ids(self.tokenizer, self._ids[self._prefix_offset:self._read_offset],
                            self.skip_special_tokens)
        full = decode_ids(self.tokenizer, self._ids[self._prefix_offset:], self.skip_special_tokens)
        self._prefix_offset = self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += full[len(prefix):]
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # Only a match that ends in the new text is new.
            at = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop)] if self.include_stop else self.text[:at]
        self.finished = True
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text to show now: all of it once finished, else minus the held-back tail."""
        if finished or self.finished or self._hold == 0:
            return self.text
        return self.text[:max(0, len(self.text) - self._hold)]


class TokenTextCache:
    """Decoded text of single tokens (for logprobs), memoized."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = decode_ids(self.tokenizer, [token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text
