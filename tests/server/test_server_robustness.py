"""Malformed requests, API keys, disconnects and engine failures, over raw HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from dsv4.server.app import build_app
from dsv4.server.async_engine import AsyncEngine
from server_fakes import MODEL, FakeEngine, ServerThread, wait_until

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def post(srv, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(srv.url + path, json=body, timeout=20, **kw)
    return httpx.post(srv.url + path, content=body, timeout=20,
                      headers={"content-type": "application/json"}, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("path,body,param,fragment", [
    (CHAT, b'{"messages": [', None, "Invalid JSON"),
    (CHAT, b"[1, 2]", None, "JSON object"),
    (CHAT, {"model": MODEL}, "messages", "Field required"),
    (CHAT, {"messages": USER, "temperature": "hot"}, "temperature", "number"),
    (CHAT, {"messages": USER, "top_p": 5}, "top_p", "(0, 1]"),
    (CHAT, {"messages": USER, "n": 0}, "n", "greater than or equal to 1"),
    (CHAT, {"messages": USER, "top_logprobs": 50, "logprobs": True}, "top_logprobs", "20"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "wizard"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "found int"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function", "object"),
    (CHAT, {"messages": USER, "tool_choice": "required", "tools": []}, "tool_choice", "auto"),
    (CHAT, {"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort", "extreme"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"thinking": "yes"}},
     "chat_template_kwargs.thinking", "true or false"),
    (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens", ">= 1"),
    (CHAT, {"messages": USER, "stop": [""]}, "stop", "non-empty"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, -4]}, "prompt", "out of range"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
])
def test_bad_requests_are_400(served, path, body, param, fragment) -> None:
    engine, _, srv = served
    before = len(engine.prompts)
    err = error_of(post(srv, path, body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert fragment in err["message"]
    assert len(engine.prompts) == before  # nothing reached the engine


def test_prompt_over_the_limit(served) -> None:
    engine, _, srv = served
    err = error_of(post(srv, CHAT, {"messages": [{"role": "user", "content": "x" * 3000}]}), 400)
    assert "2048" in err["message"] and err["code"] == "context_length_exceeded"
    err = error_of(post(srv, "/v1/completions", {"prompt": "abc", "max_tokens": 2046}), 400)
    assert "2049" in err["message"] and err["param"] == "max_tokens"


def test_unknown_fields_ignored_and_unknown_model(served) -> None:
    _, _, srv = served
    r = post(srv, CHAT, {"messages": USER, "frobnicate": {"x": 1}, "logit_bias": {}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    err = error_of(post(srv, CHAT, {"model": "gpt-9", "messages": USER}), 404)
    assert err["param"] == "model"
    assert error_of(httpx.get(srv.url + "/v1/nothing"), 404)["type"] == "not_found_error"


def test_metrics_count_outcomes(served) -> None:
    _, _, srv = served

    def count(status: str) -> float:
        for line in httpx.get(srv.url + "/metrics").text.splitlines():
            if line.startswith(f'dsv4_requests_total{{status="{status}"}}'):
                return float(line.split()[-1])
        raise AssertionError(status)

    ok, bad = count("ok"), count("bad_request")
    post(srv, CHAT, {"messages": USER})
    post(srv, CHAT, {"messages": USER, "top_p": -1})
    assert (count("ok"), count("bad_request")) == (ok + 1, bad + 1)
    text = httpx.get(srv.url + "/metrics").text
    assert "dsv4_generation_tokens_total" in text and "dsv4_time_per_output_token_seconds_count" in text


def test_client_disconnect_mid_stream_aborts(served) -> None:
    engine, async_engine, srv = served
    engine.script = lambda prompt, i: "x" * 10_000
    engine.step_delay = 0.005
    with httpx.Client(timeout=20) as c:
        with c.stream("POST", srv.url + CHAT, json={"messages": USER, "stream": True,
                                                     "max_tokens": 1500}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert got[0].startswith("data: ")
    assert wait_until(lambda: engine.aborted and not engine.has_unfinished_requests())
    engine_idle(async_engine)


def engine_idle(async_engine: AsyncEngine) -> None:
    """check_idle, run on the engine thread as the server would."""
    async def run() -> None:
        await async_engine.check_idle()
    asyncio.run(run())


def test_client_disconnect_non_streaming_aborts(served) -> None:
    engine, async_engine, srv = served
    engine.script = lambda prompt, i: "y" * 10_000
    engine.step_delay = 0.005
    n_aborted = len(engine.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + CHAT, json={"messages": USER, "max_tokens": 1500}, timeout=0.5)
    assert wait_until(lambda: len(engine.aborted) > n_aborted and not engine.has_unfinished_requests())
    engine_idle(async_engine)


def test_engine_step_failure_does_not_kill_the_server(served) -> None:
    engine, _, srv = served
    engine.step_delay = 0.01
    engine.fail_next_step = True
    err = error_of(post(srv, CHAT, {"messages": USER}), 500)
    assert "injected step failure" in err["message"]
    # streaming: the error arrives as an event, then [DONE]
    engine.fail_next_step = True
    r = post(srv, CHAT, {"messages": USER, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "injected step failure" in json.loads(events[-2])["error"]["message"]
    assert post(srv, CHAT, {"messages": USER}).status_code == 200


def test_concurrent_streams_are_independent(served) -> None:
    engine, _, srv = served
    engine.script = lambda prompt, i: prompt.split("<｜User｜>")[1].split("<｜Assistant｜>")[0] * 4

    async def one(k: int, c: httpx.AsyncClient) -> str:
        body = {"messages": [{"role": "user", "content": f"q{k:04d}"}], "stream": True}
        text = ""
        async with c.stream("POST", srv.url + CHAT, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        text += ch["delta"].get("content") or ""
        return text

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*(one(k, c) for k in range(16)))

    texts = asyncio.run(main())
    assert texts == [f"q{k:04d}" * 4 for k in range(16)]


def test_api_key() -> None:
    engine = FakeEngine()
    app = build_app(AsyncEngine(engine, idle_poll_s=0.05), model_name=MODEL, api_key="s3cret")
    with ServerThread(app) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            err = error_of(httpx.post(srv.url + CHAT, json={"messages": USER}, headers=headers), 401)
            assert err["type"] == "authentication_error"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        ok = httpx.post(srv.url + CHAT, json={"messages": USER},
                        headers={"Authorization": "Bearer s3cret"}, timeout=20)
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # not behind the key
        assert engine.prompts and len(engine.prompts) == 1
    assert wait_until(lambda: not engine.has_unfinished_requests())
