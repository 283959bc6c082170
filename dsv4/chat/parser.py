"""Streaming parser of DeepSeek-V4 / V4.1 output: reasoning, content and DSML tool calls.

Feed it the decoded text deltas of one completion; each ``feed`` returns what became certain:
reasoning text (thinking mode, before ``</think>``), content text, and whole tool calls (one
per closed ``invoke``).  Text that could still be the start of a tag is held back, so no tag
fragment ever reaches reasoning or content, wherever the deltas split the tags.  Trailing
whitespace is held back too, because the blank line before a tool-call block belongs to the
markup.

Both DSML spellings are recognized (V4 ``<｜DSML｜tool_calls>``, V4.1 ``<｜DSML｜ calls>``), and a
tool-call block also ends the reasoning when the model skipped ``</think>`` (a known failure
mode).  A parameter with ``string="true"`` is a raw string; any other value is parsed as JSON
(falling back to the raw string when it is not valid JSON).
"""

from __future__ import annotations

import codecs
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from dsv4.chat.format import EOS, THINK_CLOSE, THINK_OPEN, V41_TAGS, V4_TAGS, DsmlTags, check_variant

_ATTR = re.compile(r'([A-Za-z_]\w*)\s*=\s*"([^"]*)"')


@dataclass
class ToolCall:
    """One parsed tool call; ``arguments`` is the text of a JSON object."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class ParsedDelta:
    """What one ``feed`` made certain (any part may be empty)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


class OutputParser:
    """Incremental splitter of one completion's text (see the module docstring).

    ``thinking``: the prompt ended with ``<think>``, so the output starts with reasoning.
    ``parse_tools``: recognize DSML tool-call blocks (off: they stay in the content).
    """

    def __init__(self, *, thinking: bool = False, variant: str = "v4", parse_tools: bool = True,
                 id_factory: Callable[[], str] = new_tool_call_id) -> None:
        check_variant(variant)
        self._mode = "reasoning" if thinking else "content"
        self._parse_tools = parse_tools
        self._id_factory = id_factory
        self._buf = ""
        self._content_started = False  # non-whitespace content emitted
        self._decoder: codecs.IncrementalDecoder | None = None
        # inside a tool-call block
        self._tags: DsmlTags = V4_TAGS
        self._tool_state = "between"
        self._call_name: str | None = None
        self._call_args: dict = {}
        self._param: tuple[str, str | None] | None = None
        self._num_calls = 0

    @property
    def tool_calls_seen(self) -> int:
        """How many tool calls were emitted so far."""
        return self._num_calls

    # ------------------------------------------------------------------ public API
    def feed(self, delta: str | bytes) -> ParsedDelta:
        """Add the next piece of output text (str, or UTF-8 bytes split anywhere)."""
        if isinstance(delta, bytes):
            if self._decoder is None:
                self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            delta = self._decoder.decode(delta)
        self._buf += delta
        out = ParsedDelta()
        self._run(out)
        return out

    def finish(self) -> ParsedDelta:
        """End of output: flush held-back text.  An unterminated tool call is dropped, and
        so is a held-back partial special token (text containing ``｜``)."""
        if self._decoder is not None:
            self._buf += self._decoder.decode(b"", final=True)
        out = ParsedDelta()
        self._run(out)
        if self._mode in ("reasoning", "content") and self._buf:
            # what is left is trailing whitespace and/or the start of a tag that never came
            partial = self._buf.lstrip()
            if not ("\uff5c" in partial and self._is_tag_prefix(partial)):
                self._emit(out, self._buf)
        self._buf = ""
        self._mode = "done"
        return out

    # ------------------------------------------------------------------ text modes
    def _text_tags(self) -> list[str]:
        tags = [EOS]
        if self._parse_tools:
            tags += [V4_TAGS.block_open, V41_TAGS.block_open]
        if self._mode == "reasoning":
            tags += [THINK_CLOSE, THINK_OPEN]
        elif not self._content_started:
            tags += [THINK_CLOSE, THINK_OPEN]  # a stray think tag at the very start
        return tags

    def _is_tag_prefix(self, s: str) -> bool:
        return any(t.startswith(s) for t in self._text_tags())

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if self._mode == "reasoning":
            out.reasoning += text
        else:
            out.content += text
            if text.strip():
                self._content_started = True

    def _run(self, out: ParsedDelta) -> None:
        while self._buf:
            if self._mode == "done":
                self._buf = ""
                return
            if self._mode == "tools":
                if not self._step_tools(out):
                    return
                continue
            tags = self._text_tags()
            hit, pos = None, -1
            for t in tags:
                p = self._buf.find(t)
                if p != -1 and (pos == -1 or p < pos or (p == pos and len(t) > len(hit))):
                    hit, pos = t, p
            if hit is None:
                keep = self._holdback(tags)
                self._emit(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            before, self._buf = self._buf[:pos], self._buf[pos + len(hit):]
            self._on_tag(out, hit, before)

    def _holdback(self, tags: list[str]) -> int:
        """Length of the buffer's tail that must wait: a possible tag start plus the
        whitespace before it (a blank line may precede a tool-call block)."""
        buf = self._buf
        keep = 0
        for t in tags:
            for k in range(min(len(t) - 1, len(buf)), keep, -1):
                if buf.endswith(t[:k]):
                    keep = k
                    break
        end = len(buf) - keep
        while end > 0 and buf[end - 1].isspace():
            end -= 1
        return len(buf) - end

    def _on_tag(self, out: ParsedDelta, tag: str, before: str) -> None:
        if tag in (V4_TAGS.block_open, V41_TAGS.block_open):
            self._emit(out, before.rstrip())  # the blank line before the block is markup
            self._tags = V4_TAGS if tag == V4_TAGS.block_open else V41_TAGS
            self._mode, self._tool_state = "tools", "between"
            return
        if tag in (THINK_OPEN, THINK_CLOSE) and self._mode == "content" and (
                self._content_started or before.strip()):
            self._emit(out, before + tag)  # inside the answer a think tag is plain text
            return
        self._emit(out, before)
        if tag == EOS:
            self._mode = "done"
        elif tag == THINK_CLOSE and self._mode == "reasoning":
            self._mode = "content"
        elif tag == THINK_OPEN and self._mode == "content":
            self._mode = "reasoning"  # the model opened a reasoning block itself
        # a repeated <think> in reasoning, or a stray </think> at the start of content: dropped

    # ------------------------------------------------------------------ tool-call block
    def _step_tools(self, out: ParsedDelta) -> bool:
        """Advance inside a tool-call block; False when more text is needed."""
        tags, buf, state = self._tags, self._buf, self._tool_state
        if state == "between":
            i, c = buf.find(tags.invoke_start), buf.find(tags.block_close)
            e = buf.find(EOS)
            if e != -1 and (i == -1 or e < i) and (c == -1 or e < c):
                self._buf, self._mode = "", "done"
                return False
            if c != -1 and (i == -1 or c < i):
                self._buf, self._mode = buf[c + len(tags.block_close):], "content"
                return True
            if i == -1:
                return False
            self._buf, self._tool_state = buf[i + len(tags.invoke_start):], "invoke_header"
            self._call_name, self._call_args = None, {}
            return True
        if state == "invoke_header":
            attrs = self._take_attrs()
            if attrs is None:
                return False
            self._call_name = attrs.get("name") or None  # no name: the call is dropped
            self._tool_state = "invoke_body"
            return True
        if state == "invoke_body":
            p, c = buf.find(tags.parameter_start), buf.find(tags.invoke_close)
            if c != -1 and (p == -1 or c < p):
                self._buf, self._tool_state = buf[c + len(tags.invoke_close):], "between"
                if self._call_name:
                    out.tool_calls.append(ToolCall(
                        index=self._num_calls, id=self._id_factory(), name=self._call_name,
                        arguments=json.dumps(self._call_args, ensure_ascii=False)))
                    self._num_calls += 1
                return True
            if p == -1:
                return False
            self._buf, self._tool_state = buf[p + len(tags.parameter_start):], "param_header"
            return True
        if state == "param_header":
            attrs = self._take_attrs()
            if attrs is None:
                return False
            self._param = (attrs["name"], attrs.get("string")) if "name" in attrs else None
            self._tool_state = "param_value"
            return True
        # param_value: everything up to the closing parameter tag
        c = buf.find(tags.parameter_close)
        if c == -1:
            return False
        if self._param is not None:
            name, is_string = self._param
            self._call_args[name] = _param_value(buf[:c], is_string)
        self._buf, self._tool_state = buf[c + len(tags.parameter_close):], "invoke_body"
        return True

    def _take_attrs(self) -> dict[str, str] | None:
        """Consume a tag's attributes up to its closing '>' (None: not complete yet)."""
        buf, i, quoted = self._buf, 0, False
        while i < len(buf) and (quoted or buf[i] != ">"):
            quoted ^= buf[i] == '"'
            i += 1
        if i == len(buf):
            return None
        self._buf = buf[i + 1:]
        return dict(_ATTR.findall(buf[:i]))


def _param_value(raw: str, is_string: str | None) -> object:
    if is_string == "true":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # not JSON after all: keep the text rather than lose the argument


def parse_output(text: str, *, thinking: bool = False, variant: str = "v4",
                 parse_tools: bool = True) -> tuple[str, str, list[ToolCall]]:
    """Split a whole completion into ``(reasoning, content, tool_calls)``."""
    parser = OutputParser(thinking=thinking, variant=variant, parse_tools=parse_tools)
    first, last = parser.feed(text), parser.finish()
    return (first.reasoning + last.reasoning, first.content + last.content,
            first.tool_calls + last.tool_calls)
