"""``POST /v1/chat/completions``: the DeepSeek chat format in, reasoning / content / tool calls out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from dsv4.chat.encoding import encode_messages
from dsv4.chat.parser import OutputParser, ParsedDelta
from dsv4.server.protocol import (
    ChatCompletionRequest,
    bad_request,
    chat_logprobs,
    param_of,
    sampling_kwargs,
)
from dsv4.server.state import (
    RequestTracker,
    ServerState,
    collect_or_abort,
    sse_response,
    usage_of,
)

# OpenAI-style effort names that DeepSeek does not have, mapped to the nearest one.
EFFORT_SYNONYMS = {"minimal": "low", "xhigh": "max"}


def resolve_thinking(req: ChatCompletionRequest, default: bool) -> tuple[bool, Any]:
    """(thinking, reasoning_effort) of a request.

    ``chat_template_kwargs.thinking`` (or ``enable_thinking``) decides; else a reasoning effort
    other than "none" turns thinking on; else the server default.  Effort "none" means chat mode.
    """
    kwargs = req.chat_template_kwargs or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        key = "thinking" if "thinking" in kwargs else "enable_thinking"
        raise bad_request(f"chat_template_kwargs.{key}: expected true or false, found "
                          f"{thinking!r}", param=f"chat_template_kwargs.{key}")
    effort = req.reasoning_effort if req.reasoning_effort is not None else kwargs.get(
        "reasoning_effort")
    if effort == "none":
        return False, None
    effort = EFFORT_SYNONYMS.get(effort, effort) if isinstance(effort, str) else effort
    if thinking is None:
        thinking = default or effort is not None
    return thinking, effort


@dataclass
class _Choice:
    parser: OutputParser
    text_len: int = 0
    num_tokens: int = 0
    reasoning: str = ""
    content: str = ""
    tool_calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


def _tool_call_json(tc: Any) -> dict:
    return {"id": tc.id, "type": "function",
            "function": {"name": tc.name, "arguments": tc.arguments}}


def _finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    if reason == "stop" and has_tool_calls:
        return "tool_calls"
    if reason == "abort":
        return "stop"  # only a server shutdown aborts a request whose client is still there
    return reason


class _ChatRun:
    """Turns one engine request's cumulative outputs into choice deltas."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, thinking: bool,
                 parse_tools: bool, tracker: RequestTracker, num_prompt: int) -> None:
        self.state = state
        self.num_prompt = num_prompt
        self.req = req
        self.tracker = tracker
        self.k = (req.top_logprobs or 0) if req.logprobs else None
        self.choices = [_Choice(OutputParser(thinking=thinking, variant=state.variant,
                                             parse_tools=parse_tools)) for _ in range(req.n)]

    def advance(self, out: Any) -> list[tuple[int, ParsedDelta, dict | None, str | None]]:
        """(index, parsed delta, logprobs, finish reason) of each choice that moved."""
        self.tracker.on_output(out)
        moved = []
        for o in out.outputs:
            ch = self.choices[o.index]
            if ch.finish_reason is not None:
                continue
            delta = ch.parser.feed(o.text[ch.text_len:]) if len(o.text) > ch.text_len else ParsedDelta()
            ch.text_len = max(ch.text_len, len(o.text))
            logprobs = None
            if self.k is not None and len(o.token_ids) > ch.num_tokens and o.logprobs:
                logprobs = chat_logprobs(o.logprobs[ch.num_tokens:len(o.token_ids)],
                                         o.token_ids[ch.num_tokens:], self.k, self.state.token_text)
            ch.num_tokens = len(o.token_ids)
            if logprobs:
                ch.logprobs += logprobs["content"]
            finish = None
            if o.finish_reason is not None:
                tail = ch.parser.finish()
                delta = ParsedDelta(delta.reasoning + tail.reasoning, delta.content + tail.content,
                                    delta.tool_calls + tail.tool_calls)
            ch.reasoning += delta.reasoning
            ch.content += delta.content
            ch.tool_calls += delta.tool_calls
            if o.finish_reason is not None:
                ch.finish_reason = finish = _finish_reason(o.finish_reason, bool(ch.tool_calls))
            if delta or logprobs or finish:
                moved.append((o.index, delta, logprobs, finish))
        return moved

    def usage(self) -> dict:
        return usage_of(self.num_prompt, sum(ch.num_tokens for ch in self.choices))


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                 request: Request) -> Any:
    """Validate, encode, run, and answer (JSON or SSE)."""
    arrival = time.monotonic()
    state.check_model(req.model)
    thinking, effort = resolve_thinking(req, state.default_thinking)
    if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
        raise bad_request("tool_choice: only 'auto' and 'none' are supported (the model decides "
                          "whether to call a tool)", param="tool_choice")
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    try:
        prompt = encode_messages(req.messages, variant=state.variant, thinking=thinking,
                                 reasoning_effort=effort, tools=tools)
    except ValueError as e:
        raise bad_request(str(e), param=param_of(str(e))) from None
    prompt_ids = await state.tokenize(prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    state.check_length(len(prompt_ids), max_tokens, "messages")
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = state.sampling_params(sampling_kwargs(
        req, max_tokens=max_tokens, logprobs=k, skip_special_tokens=req.skip_special_tokens))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    tracker = state.tracker(len(prompt_ids), arrival)
    run = _ChatRun(state, req, thinking, tools is not None, tracker, len(prompt_ids))
    outputs = state.engine.generate(prompt_ids, params, rid)
    if req.stream:
        return StreamingResponse(_stream(state, req, run, rid, outputs),
                                 media_type="text/event-stream")

    async def collect() -> None:
        async with aclosing(outputs) as it:
            async for out in it:
                run.advance(out)

    aborted = await collect_or_abort(request, tracker, collect())
    if aborted is not None:
        return aborted
    choices = []
    for i, ch in enumerate(run.choices):
        message: dict[str, Any] = {"role": "assistant",
                                   "content": ch.content if ch.content or not ch.tool_calls else None}
        if ch.reasoning or thinking:
            message["reasoning_content"] = ch.reasoning or None
        if ch.tool_calls:
            message["tool_calls"] = [_tool_call_json(tc) for tc in ch.tool_calls]
        choices.append({"index": i, "message": message, "finish_reason": ch.finish_reason,
                        "logprobs": {"content": ch.logprobs} if run.k is not None else None})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                         "model": state.model_name, "choices": choices, "usage": run.usage()})


async def _stream(state: ServerState, req: ChatCompletionRequest, run: _ChatRun, rid: str,
                  outputs: AsyncIterator[Any]) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model_name}
    usage_null = {"usage": None} if req.include_usage else {}

    def chunk(index: int, delta: dict, logprobs: dict | None = None,
              finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}], **usage_null}

    async def chunks() -> AsyncIterator[dict]:
        # Closing `outputs` (the client left) aborts the engine request.
        async with aclosing(outputs) as it:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for out in it:
                for index, d, logprobs, finish in run.advance(out):
                    delta: dict[str, Any] = {}
                    if d.reasoning:
                        delta["reasoning_content"] = d.reasoning
                    if d.content:
                        delta["content"] = d.content
                    if d.tool_calls:
                        delta["tool_calls"] = [{"index": tc.index, **_tool_call_json(tc)}
                                               for tc in d.tool_calls]
                    yield chunk(index, delta, logprobs, finish)

    def usage_chunk() -> dict | None:
        return {**head, "choices": [], "usage": run.usage()} if req.include_usage else None

    async for line in sse_response(chunks(), run.tracker, usage_chunk):
        yield line
