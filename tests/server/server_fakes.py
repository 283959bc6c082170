"""A scripted stand-in for ``LLMEngine`` (same API) and a uvicorn server in a thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import uvicorn

from dsv4.engine.sampling_params import CompletionOutput, Logprob, RequestOutput, SamplingParams

EOS_ID = 1
MODEL = "fake-dsv4"  # the served model name of the fake-engine tests


class CharTokenizer:
    """One token per character (id = code point); id 1 is eos."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS_ID))


@dataclass
class _Seq:
    index: int
    script: str
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Req:
    rid: str
    prompt_ids: list
    params: SamplingParams
    seqs: list


class FakeEngine:
    """Generates ``script(prompt_text, seq_index)`` one character per step per sequence.

    Knobs: ``step_delay`` (seconds per step), ``fail_next_step`` (the next step raises).
    Records every prompt (``prompts``), aborted ids (``aborted``); ``check_idle`` raises while
    any request holds "pages".
    """

    def __init__(self, variant: str = "v4", max_model_len: int = 2048) -> None:
        self.config = SimpleNamespace(variant=variant, vocab_size=0x110000)
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.script: Callable[[str, int], str] = lambda prompt, i: "Hello from the fake engine."
        self.step_delay = 0.0
        self.fail_next_step = False
        self.prompts: list[str] = []
        self.aborted: list[str] = []
        self._reqs: dict[str, _Req] = {}
        self._lock = threading.Lock()  # only to catch concurrent use in tests
        self.thread_ids: set[int] = set()

    def _enter(self) -> None:
        self.thread_ids.add(threading.get_ident())
        if not self._lock.acquire(blocking=False):
            raise AssertionError("FakeEngine used from two threads at once")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self._enter()
        try:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens >= max_model_len={self.max_model_len}")
            text = self.tokenizer.decode(ids)
            self.prompts.append(text)
            seqs = [_Seq(i, self.script(text, i)) for i in range(params.n)]
            self._reqs[request_id] = _Req(request_id, ids, params, seqs)
        finally:
            self._lock.release()

    def abort_request(self, request_id: str) -> None:
        self._enter()
        try:
            if self._reqs.pop(request_id, None) is not None:
                self.aborted.append(request_id)
        finally:
            self._lock.release()

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[RequestOutput]:
        self._enter()
        try:
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.fail_next_step:
                self.fail_next_step = False
                raise RuntimeError("injected step failure")
            outs = []
            for rid, req in list(self._reqs.items()):
                for s in req.seqs:
                    if s.finish_reason is None:
                        self._advance(req, s)
                done = all(s.finish_reason is not None for s in req.seqs)
                outs.append(RequestOutput(
                    request_id=rid, prompt=None, prompt_token_ids=req.prompt_ids,
                    prompt_logprobs=None, finished=done,
                    outputs=[CompletionOutput(index=s.index, text=s.text, token_ids=list(s.token_ids),
                                              logprobs=list(s.logprobs) if req.params.logprobs is not None else None,
                                              finish_reason=s.finish_reason) for s in req.seqs]))
                if done:
                    del self._reqs[rid]
            return outs
        finally:
            self._lock.release()

    def _advance(self, req: _Req, s: _Seq) -> None:
        p = req.params
        if len(s.token_ids) < len(s.script):
            ch = s.script[len(s.token_ids)]
            tid = ord(ch)
            s.text += ch
        else:
            tid = EOS_ID
        s.token_ids.append(tid)
        if p.logprobs is not None:
            alt = ord("?") if tid != ord("?") else ord("!")
            s.logprobs.append({tid: Logprob(-0.25, 1, chr(tid)), alt: Logprob(-1.5, 2, chr(alt))})
        for stop in p.stop:
            at = s.text.find(stop)
            if at >= 0:
                s.text, s.finish_reason = s.text[:at], "stop"
                return
        if tid == EOS_ID:
            s.finish_reason = "stop"
        elif p.max_tokens is not None and len(s.token_ids) >= p.max_tokens:
            s.finish_reason = "length"

    def get_stats(self) -> dict:
        return {"num_running": len(self._reqs), "num_waiting": 0,
                "cache_usage": min(1.0, 0.1 * len(self._reqs))}

    def check_idle(self) -> None:
        if self._reqs:
            raise RuntimeError(f"requests still hold pages: {sorted(self._reqs)}")


class ServerThread:
    """uvicorn serving ``app`` on a free loopback port, in a background thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()
