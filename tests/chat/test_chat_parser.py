"""The streaming output parser: every tag split at every position, bytes included."""

from __future__ import annotations

import json
import random

import pytest

from dsv4.chat.parser import OutputParser, ParsedDelta, parse_output

EOS = "<｜end▁of▁sentence｜>"
V4_CALL = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Pa"ris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">[1, 2]</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="noop">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)
V41_CALL = (
    "\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="lookup">\n'
    '<｜DSML｜ parameter name="q" string="true">a <b> ü</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="n" string="false">{"k": true}</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)
V4_CALLS = [("get_weather", {"city": 'Pa"ris', "days": [1, 2]}), ("noop", {})]
V41_CALLS = [("lookup", {"q": "a <b> ü", "n": {"k": True}})]

# (thinking, text, expected reasoning, expected content, expected calls): together these put
# every tag (</think>, <think>, both DSML spellings of block / invoke / parameter open and
# close, eos) somewhere a split can cut it.
CASES = [
    (True, "Let me think.\n</think>The answer is 4.", "Let me think.\n", "The answer is 4.", []),
    (True, "<think>r</think>c", "r", "c", []),
    (True, f"plan  </think>Checking.{V4_CALL}{EOS}", "plan  ", "Checking.", V4_CALLS),
    (False, f"Sure.{V41_CALL}{EOS}", "", "Sure.", V41_CALLS),
    (False, f"x < y and a</b>{EOS}ignored", "", "x < y and a</b>", []),
    (True, f"skipped end of thinking{V41_CALL}", "skipped end of thinking", "", V41_CALLS),
    (False, f"</think>hi{V4_CALL}\nAfter the calls.", "", "hi\nAfter the calls.", V4_CALLS),
]


def _collect(deltas: list[ParsedDelta]) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls]
    assert [c.index for c in calls] == list(range(len(calls)))
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


def _run(thinking: bool, pieces: list) -> tuple[str, str, list]:
    p = OutputParser(thinking=thinking)
    deltas = [p.feed(x) for x in pieces]
    deltas.append(p.finish())
    return _collect(deltas)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_two_piece_split(case: int) -> None:
    thinking, text, reasoning, content, calls = CASES[case]
    expected = (reasoning, content, calls)
    assert _run(thinking, [text]) == expected
    for i in range(len(text) + 1):
        assert _run(thinking, [text[:i], text[i:]]) == expected, f"split at {i}"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_char_by_char_and_byte_by_byte(case: int) -> None:
    thinking, text, reasoning, content, calls = CASES[case]
    expected = (reasoning, content, calls)
    assert _run(thinking, list(text)) == expected
    data = text.encode()
    assert _run(thinking, [data[i:i + 1] for i in range(len(data))]) == expected
    # every byte split point, including inside multi-byte characters
    for i in range(len(data) + 1):
        assert _run(thinking, [data[:i], data[i:]]) == expected, f"byte split at {i}"


def test_random_three_piece_splits() -> None:
    rng = random.Random(0)
    for thinking, text, reasoning, content, calls in CASES:
        for _ in range(300):
            i, j = sorted(rng.sample(range(len(text) + 1), 2))
            assert _run(thinking, [text[:i], text[i:j], text[j:]]) == (reasoning, content, calls)


def test_no_partial_tag_is_ever_emitted() -> None:
    """Fed one character at a time, no emitted chunk may end inside a tag."""
    thinking, text = True, f"a</think>b{V4_CALL}"
    p = OutputParser(thinking=thinking)
    emitted = ""
    for ch in text:
        d = p.feed(ch)
        emitted += d.reasoning + d.content
        assert "<" not in emitted and "｜" not in emitted
    assert emitted == "ab"


def test_parse_output_matches_streaming() -> None:
    for thinking, text, reasoning, content, calls in CASES:
        r, c, tc = parse_output(text, thinking=thinking)
        assert (r, c, [(x.name, json.loads(x.arguments)) for x in tc]) == (reasoning, content, calls)


def test_parse_tools_off_keeps_markup_as_content() -> None:
    text = f"Sure.{V41_CALL}"
    _, content, calls = parse_output(text, parse_tools=False)
    assert content == text and calls == []


def test_truncated_outputs() -> None:
    # cut inside a tool-call block: nothing of it leaks, and the open call is dropped
    cut = f"Sure.{V4_CALL}"[: len("Sure.") + 60]
    assert parse_output(cut) == ("", "Sure.", [])
    # cut inside a special token: dropped; a plain '<' at the end is ordinary text
    assert parse_output("done <｜DSML｜tool") == ("", "done", [])
    assert parse_output("a <") == ("", "a <", [])
    # reasoning never closed
    assert parse_output("still thinking\n", thinking=True) == ("still thinking\n", "", [])


def test_think_tags_inside_the_answer_are_text() -> None:
    assert parse_output("use <think> tags</think>")[1] == "use <think> tags</think>"


def test_invalid_json_parameter_kept_as_string() -> None:
    text = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="x" string="false">not json</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    _, _, calls = parse_output(text)
    assert json.loads(calls[0].arguments) == {"x": "not json"}
    assert calls[0].id.startswith("call_")


def test_unknown_variant_rejected() -> None:
    with pytest.raises(ValueError, match="variant"):
        OutputParser(variant="v3")


def test_attributes_in_any_order_and_spacing() -> None:
    text = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke  name = "f" >\n'
            '<｜DSML｜parameter string="false" name="a>b">[1]</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="s">x</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n<｜DSML｜invoke>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    _, _, calls = parse_output(text)
    # a missing string attribute means JSON-or-text; an invoke without a name is dropped
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a>b": [1], "s": "x"})]
