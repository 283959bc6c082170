"""The server over a scripted engine, talked to with the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_fakes import MODEL


DSML_CALL = (
    "Let me check.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}]


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def test_models_health_metrics(served) -> None:
    engine, _, srv = served
    models = client(srv).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    text = httpx.get(srv.url + "/metrics").text
    for name in ("dsv4_requests_total{status=\"ok\"}", "dsv4_num_requests_running",
                 "dsv4_time_to_first_token_seconds_bucket{le=\"+Inf\"}", "dsv4_cache_usage"):
        assert name in text


def test_chat_non_streaming(served) -> None:
    engine, _, srv = served
    r = client(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be nice."},
                               {"role": "user", "content": "Hi"}], max_tokens=100)
    assert r.choices[0].message.content == "Hello from the fake engine."
    assert r.choices[0].finish_reason == "stop"
    prompt = engine.prompts[-1]
    assert prompt == "<｜begin▁of▁sentence｜>Be nice.<｜User｜>Hi<｜Assistant｜></think>"
    # completion tokens: the script plus eos
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len("Hello from the fake engine.") + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage(served) -> None:
    engine, _, srv = served
    chunks = list(client(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
        stream_options={"include_usage": True}, max_tokens=10))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Hello from"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_reasoning_split(served) -> None:
    engine, _, srv = served
    engine.script = lambda prompt, i: "First, 2+2.\n</think>It is 4."
    c = client(srv)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}],
                                  extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = r.choices[0].message
    assert engine.prompts[-1].endswith("<｜Assistant｜><think>")
    assert msg.content == "It is 4."
    assert msg.model_extra["reasoning_content"] == "First, 2+2.\n"
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "2+2?"}], stream=True,
        reasoning_effort="high"))  # an effort alone turns thinking on
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "First, 2+2.\n"
    assert "".join(d.content or "" for d in deltas) == "It is 4."
    # chat mode: the same output is all content (the stray tag at the start is not)
    engine.script = lambda prompt, i: "</think>Plain."
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "Plain."


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(served, stream: bool) -> None:
    engine, _, srv = served
    engine.script = lambda prompt, i: DSML_CALL if "<tool_result>" not in prompt else "Sunny, 3 days."
    c = client(srv)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        chunks = list(c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        content = "".join(d.content or "" for d in deltas)
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        name, args, call_id = calls[0].function.name, calls[0].function.arguments, calls[0].id
        assert calls[0].index == 0
    else:
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        calls = r.choices[0].message.tool_calls
        name, args, call_id = calls[0].function.name, calls[0].function.arguments, calls[0].id
    assert content == "Let me check."
    assert len(calls) == 1 and name == "get_weather"
    assert json.loads(args) == {"city": "Paris", "days": 3}
    assert finish == "tool_calls"
    assert "## Tools" in engine.prompts[-1] and '"name": "get_weather"' in engine.prompts[-1]

    messages += [{"role": "assistant", "content": content,
                  "tool_calls": [{"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": '{"sky": "sunny"}'}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "Sunny, 3 days."
    assert r.choices[0].message.tool_calls is None
    prompt = engine.prompts[-1]
    assert ('<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>' in prompt)
    assert prompt.endswith('<｜User｜><tool_result>{"sky": "sunny"}</tool_result>'
                           "<｜Assistant｜></think>")


def test_tool_choice_none_leaves_markup_in_content(served) -> None:
    engine, _, srv = served
    engine.script = lambda prompt, i: DSML_CALL
    r = client(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == DSML_CALL
    assert "## Tools" not in engine.prompts[-1]


def test_chat_n_and_logprobs(served) -> None:
    engine, _, srv = served
    engine.script = lambda prompt, i: f"choice {i}"
    r = client(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, logprobs=True,
        top_logprobs=2, seed=5)
    assert [ch.message.content for ch in r.choices] == ["choice 0", "choice 1", "choice 2"]
    lp = r.choices[1].logprobs.content
    assert "".join(t.token for t in lp) == "choice 1\x01"  # the eos token is decoded too
    assert lp[0].logprob == -0.25 and lp[0].bytes == list(b"c")
    assert [t.token for t in lp[0].top_logprobs] == ["c", "?"]
    assert r.usage.completion_tokens == 3 * (len("choice 0") + 1)


def test_completions(served) -> None:
    engine, _, srv = served
    engine.script = lambda prompt, i: prompt.upper() + f"#{i}"
    c = client(srv)
    r = c.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=50, logprobs=1)
    assert [ch.text for ch in r.choices] == ["AB#0", "AB#1", "CD#0", "CD#1"]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].logprobs.tokens[:2] == ["A", "B"]
    assert r.choices[0].logprobs.text_offset[:3] == [0, 1, 2]
    assert r.usage.prompt_tokens == 4
    # token-id prompt, echo, stop string, streaming
    chunks = list(c.completions.create(model=MODEL, prompt=[ord("x"), ord("y")], echo=True,
                                       stop=["#"], stream=True, max_tokens=50))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "xyXY"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    # max_tokens defaults to 16 for completions
    engine.script = lambda prompt, i: "z" * 40
    r = c.completions.create(model=MODEL, prompt="q")
    assert r.choices[0].text == "z" * 16 and r.choices[0].finish_reason == "length"


def test_v41_model_uses_the_v41_format() -> None:
    from dsv4.server.app import build_app
    from dsv4.server.async_engine import AsyncEngine
    from server_fakes import FakeEngine, ServerThread

    engine = FakeEngine(variant="v41")
    engine.script = lambda prompt, i: (
        "ok</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
        "<｜DSML｜ parameter name=\"city\" string=\"true\">Rome</｜DSML｜ parameter>\n"
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    with ServerThread(build_app(AsyncEngine(engine, idle_poll_s=0.05), model_name=MODEL)) as srv:
        r = client(srv).chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "S"},
                                   {"role": "user", "content": "Rome?"}],
            tools=TOOLS, reasoning_effort=30)
    prompt = engine.prompts[-1]
    assert prompt.startswith("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 30 (range 1-100")
    assert "<｜DSML｜ calls>" in prompt and prompt.endswith("<｜User｜>Rome?<｜Assistant｜><think>")
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "ok" and msg.content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Rome"}
    assert r.choices[0].finish_reason == "tool_calls"
