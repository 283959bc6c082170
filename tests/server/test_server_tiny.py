"""The server on the real engine and the tiny checkpoint: OpenAI client, disconnect, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from dsv4.chat.encoding import encode_messages
from dsv4.server.app import build_app
from dsv4.server.async_engine import AsyncEngine
from server_fakes import ServerThread, wait_until

NAME = "tiny"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from dsv4.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_v4")), variant="v4")


@pytest.fixture(scope="module")
def tiny_server(tiny_path: str) -> Iterator[tuple]:
    from dsv4.engine.llm_engine import LLMEngine

    engine = LLMEngine(tiny_path, max_model_len=512, max_num_seqs=8)
    async_engine = AsyncEngine(engine, idle_poll_s=0.05)
    with ServerThread(build_app(async_engine, model_name=NAME)) as srv:
        yield engine, async_engine, srv
        assert wait_until(lambda: not engine.has_unfinished_requests(), 30)
        engine.check_idle()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_chat_and_completions(tiny_server) -> None:
    engine, _, srv = tiny_server
    c = _client(srv)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0)
    expected_prompt = engine.tokenizer.encode(encode_messages(msgs), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens <= 4
    assert r.choices[0].finish_reason in ("length", "stop")
    assert isinstance(r.choices[0].message.content, str)
    # streaming gives the same greedy answer
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4,
                                            temperature=0, stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == r.choices[0].message.content
    # completions with logprobs, two prompts, streaming and not
    r = c.completions.create(model=NAME, prompt=["The quick", "Once upon"], max_tokens=3,
                             temperature=0, logprobs=2)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6
    assert all(len(ch.logprobs.tokens) == 3 and len(ch.logprobs.top_logprobs[0]) == 2
               for ch in r.choices)
    chunks = list(c.completions.create(model=NAME, prompt="The quick", max_tokens=3,
                                       temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


def test_disconnect_frees_the_cache(tiny_server) -> None:
    engine, async_engine, srv = tiny_server
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a story"}],
            "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/chat/completions",
                                                  json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        next(lines)
        next(lines)
    assert wait_until(lambda: not engine.has_unfinished_requests(), 30)
    assert engine.get_stats()["requests_aborted_total"] >= 1

    import asyncio

    asyncio.run(async_engine.check_idle())
    assert async_engine.stats["cache_usage"] == 0


def test_sigterm_shuts_down_cleanly(tiny_path: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv4.server", "--model", tiny_path, "--port", str(port),
         "--max-model-len", "256", "--max-num-seqs", "4", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None

        assert wait_until(up, 90) and proc.poll() is None, proc.stdout.read() if proc.poll() else ""
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        # uvicorn re-raises the signal after its graceful shutdown, so -SIGTERM is a clean exit
        assert proc.returncode in (0, -signal.SIGTERM), out
        assert "Traceback" not in out
        assert "Application shutdown complete" in out and "engine thread stopped" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
