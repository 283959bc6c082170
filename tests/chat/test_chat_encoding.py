"""encode_messages against prompts worked by hand from DeepSeek's format description."""

from __future__ import annotations

import json

import pytest

from dsv4.chat.encoding import encode_messages
from dsv4.chat.parser import parse_output

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U, A, S = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def tools_block(dsml_open: str, invoke: str, param: str, dsml_close: str, schema_lines: str) -> str:
    """The '## Tools' section, written out from the official format description."""
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke "
        f'tools by writing a "{dsml_open}" block like the following:\n\n'
        f"{dsml_open}\n"
        f'<｜DSML｜{invoke} name="$TOOL_NAME">\n'
        f'<｜DSML｜{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
        f"</｜DSML｜{param}>\n"
        "...\n"
        f"</｜DSML｜{invoke}>\n"
        f'<｜DSML｜{invoke} name="$TOOL_NAME2">\n'
        "...\n"
        f"</｜DSML｜{invoke}>\n"
        f"{dsml_close}\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other '
        "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
        '`string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
        "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        f"{schema_lines}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
        "tool calls.\n"
    )


WEATHER_SCHEMA = ('{"name": "get_weather", "description": "Weather of a city", "parameters": '
                  '{"type": "object", "properties": {"city": {"type": "string"}}}}')


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_system_and_user_chat_mode(variant: str) -> None:
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    sys_tok = S if variant == "v41" else ""
    assert encode_messages(msgs, variant=variant) == (
        f"{BOS}{sys_tok}You are helpful.{U}Hi{A}</think>")


def test_user_only_thinking_v4() -> None:
    assert encode_messages([{"role": "user", "content": "2+2?"}], thinking=True) == (
        f"{BOS}{U}2+2?{A}<think>")


def test_multi_turn_drops_earlier_reasoning() -> None:
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    assert encode_messages(msgs, thinking=True) == (
        f"{BOS}{U}q1{A}</think>a1{EOS}{U}q2{A}<think>")
    # chat mode: no reasoning anywhere
    assert encode_messages(msgs) == f"{BOS}{U}q1{A}</think>a1{EOS}{U}q2{A}</think>"
    # drop_thinking off: the old turn keeps its reasoning and its header opens <think>
    assert encode_messages(msgs, thinking=True, drop_thinking=False) == (
        f"{BOS}{U}q1{A}<think>r1</think>a1{EOS}{U}q2{A}<think>")


def test_latest_assistant_turn_keeps_reasoning() -> None:
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert encode_messages(msgs, thinking=True) == f"{BOS}{U}q{A}<think>r</think>a{EOS}"


def test_tool_round_trip_v4() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tools",
         "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}},
         ]},
        # results arrive out of order: they are rendered in call order
        {"role": "tool", "tool_call_id": "c2", "content": "snow"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    calls = (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    tools = tools_block("<｜DSML｜tool_calls>", "invoke", "parameter", "</｜DSML｜tool_calls>",
                        WEATHER_SCHEMA)
    expected = (
        f"{BOS}Be brief.\n\n{tools}"
        f"{U}Weather in Paris and Oslo?{A}<think>need tools</think>{calls}{EOS}"
        f"{U}<tool_result>sun</tool_result>\n\n<tool_result>snow</tool_result>{A}<think>"
    )
    assert encode_messages(msgs, thinking=True, tools=[WEATHER_TOOL]) == expected

    # the model's next turn, parsed back, renders to the same assistant text
    completion = f"ok</think>Sunny in Paris.{calls}"
    reasoning, content, parsed = parse_output(completion, thinking=True)
    assert (reasoning, content) == ("ok", "Sunny in Paris.")
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]
    follow = msgs + [{"role": "assistant", "content": content, "reasoning_content": reasoning,
                      "tool_calls": [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed]}]
    assert encode_messages(follow, thinking=True, tools=[WEATHER_TOOL]).endswith(
        f"{A}<think>{completion}{EOS}")


def test_tools_without_system_message_insert_one() -> None:
    tools = tools_block("<｜DSML｜ calls>", " invoke", " parameter", "</｜DSML｜ calls>",
                        WEATHER_SCHEMA)
    out = encode_messages([{"role": "user", "content": "hi"}], variant="v41",
                          tools=[WEATHER_TOOL])
    assert out == f"{BOS}{S}\n\n{tools}{U}hi{A}</think>"
    assert "<｜DSML｜tool_calls>" not in out and "<｜DSML｜invoke" not in out


def test_v41_tool_call_spelling() -> None:
    msgs = [{"role": "user", "content": "question"},
            {"role": "assistant", "reasoning_content": "  reason  ", "content": "summary",
             "tool_calls": [{"type": "function", "function": {
                 "name": "lookup", "arguments": {"query": "value", "limit": 2}}}]}]
    expected_turn = (
        "  reason  </think>summary\n\n"
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">value</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">2</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        f"</｜DSML｜ calls>{EOS}"
    )
    effort = ("Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the "
              "reasoning)\n\n")
    assert encode_messages(msgs, variant="v41", thinking=True) == (
        f"{BOS}{S}{effort}{U}question{A}<think>{expected_turn}")


@pytest.mark.parametrize("effort,budget", [
    (None, 75), ("low", 50), ("medium", 75), ("high", 75), ("max", 100), (1, 1), (42, 42),
    (100, 100)])
def test_v41_reasoning_effort_budget(effort: object, budget: int) -> None:
    out = encode_messages([{"role": "user", "content": "q"}], variant="v41", thinking=True,
                          reasoning_effort=effort)
    assert out == (f"{BOS}{S}Reasoning Effort: {budget} (range 1-100, the higher the value, "
                   f"the more thorough the reasoning)\n\n{U}q{A}<think>")


@pytest.mark.parametrize("effort", [0, 101, -3, True, 1.5, "extreme", "50"])
def test_v41_bad_reasoning_effort(effort: object) -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "q"}], variant="v41", thinking=True,
                        reasoning_effort=effort)


def test_v41_chat_mode_has_no_effort_line() -> None:
    assert encode_messages([{"role": "user", "content": "hello"}], variant="v41",
                           reasoning_effort="max") == f"{BOS}{U}hello{A}</think>"


def test_v41_mid_conversation_system() -> None:
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "system", "content": "mid sys"},
    ]
    out = encode_messages(msgs, variant="v41", thinking=True, reasoning_effort=88)
    assert out == (f"{BOS}{S}Reasoning Effort: 88 (range 1-100, the higher the value, the more "
                   f"thorough the reasoning)\n\nsys{U}q1{A}</think>a1{EOS}{S}mid sys{A}<think>")


def test_v4_max_effort_prefix_and_errors() -> None:
    out = encode_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
                          thinking=True, reasoning_effort="max")
    assert out.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert out.endswith("left unchecked.\n\nS" + f"{U}q{A}<think>")
    for effort in ("low", "medium", "high", None):
        assert encode_messages([{"role": "user", "content": "q"}], thinking=True,
                               reasoning_effort=effort) == f"{BOS}{U}q{A}<think>"
    # chat mode: no prefix even for max
    assert encode_messages([{"role": "user", "content": "q"}], reasoning_effort="max") == (
        f"{BOS}{U}q{A}</think>")
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "q"}], thinking=True, reasoning_effort=50)


def test_content_parts_and_consecutive_users() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "user", "content": "c"}]
    assert encode_messages(msgs) == f"{BOS}{U}a\n\nb\n\nc{A}</think>"


def test_add_generation_prompt_false() -> None:
    msgs = [{"role": "user", "content": "q"}]
    assert encode_messages(msgs, add_generation_prompt=False) == f"{BOS}{U}q"


def test_v4_developer_role() -> None:
    msgs = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"}]
    assert encode_messages(msgs) == f"{BOS}{U}rules{U}q{A}</think>"
    # dropped before the last user turn in thinking mode
    assert encode_messages(msgs, thinking=True) == f"{BOS}{U}q{A}<think>"


def test_tools_keep_history_reasoning() -> None:
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"}]
    out = encode_messages(msgs, thinking=True, tools=[WEATHER_TOOL])
    assert out.endswith(f"{U}q1{A}<think>r1</think>a1{EOS}{U}q2{A}<think>")


@pytest.mark.parametrize("msgs,match", [
    ([], r"messages: expected a non-empty list"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
    ([{"role": "user"}], r"messages\[0\]\.content: required"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\]\.type: image input is not supported"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": 3}],
     r"messages\[1\]\.reasoning_content"),
    (["hello"], r"messages\[0\]: expected an object"),
])
def test_invalid_messages(msgs: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_messages(msgs)


def test_invalid_tools_and_variant() -> None:
    with pytest.raises(ValueError, match=r"tools\[0\]\.function"):
        encode_messages([{"role": "user", "content": "q"}], tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="variant"):
        encode_messages([{"role": "user", "content": "q"}], variant="v5")
