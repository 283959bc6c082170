"""OpenAI request models (pydantic, unknown fields ignored), errors and response pieces."""

from __future__ import annotations

import math
import re
from typing import Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """An error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.counted = False  # already counted in the request metrics
        default = "invalid_request_error" if status < 500 else "server_error"
        self.type = type or {401: "authentication_error", 404: "not_found_error",
                             503: "service_unavailable"}.get(status, default)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_response(err: ApiError) -> JSONResponse:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(body, status_code=err.status, headers=headers)


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")
_SP_FIELD = re.compile(r"^SamplingParams\.(\w+)")


def param_of(message: str) -> str | None:
    """The field an error message names first ('messages[1].content: …' -> that path)."""
    m = _SP_FIELD.match(message) or _FIELD_PREFIX.match(message)
    return m.group(1) if m else None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options
                    and self.stream_options.get("include_usage"))


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    reasoning_effort: Union[str, int, None] = None
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool = False  # tags are needed to split reasoning and tool calls


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    skip_special_tokens: bool = True


def sampling_kwargs(req: _Request, *, max_tokens: int | None, logprobs: int | None,
                    skip_special_tokens: bool) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments of a request (defaults left to the engine)."""
    kw: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logprobs=logprobs, skip_special_tokens=skip_special_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    return kw


# ------------------------------------------------------------------ logprobs
def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI-compatible servers clamp.
    return max(float(x), -9999.0) if not math.isnan(x) else -9999.0


def _entries(position: dict, token_id: int, k: int, text_of: Any) -> tuple[str, float, list]:
    """(sampled token text, its logprob, top-k [(text, logprob)]) of one position."""
    def text(tid: int, lp: Any) -> str:
        t = getattr(lp, "decoded_token", None)
        return t if t is not None else text_of(tid)

    def value(lp: Any) -> float:
        return _finite(getattr(lp, "logprob", lp))

    chosen = position.get(token_id)
    sampled = (text(token_id, chosen), value(chosen) if chosen is not None else -9999.0)
    ranked = sorted(position.items(), key=lambda kv: (getattr(kv[1], "rank", None) or 1 << 30,
                                                       -value(kv[1])))
    top = [(text(tid, lp), value(lp)) for tid, lp in ranked
           if tid != token_id or (getattr(lp, "rank", None) or 1 << 30) <= k][:k]
    return sampled[0], sampled[1], top


def chat_logprobs(positions: list, token_ids: list[int], k: int, text_of: Any) -> dict:
    """The ``logprobs`` object of a chat choice for these generated tokens."""
    content = []
    for pos, tid in zip(positions, token_ids):
        tok, lp, top = _entries(pos or {}, tid, k, text_of)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in top]})
    return {"content": content}


def completion_logprobs(positions: list, token_ids: list[int], k: int, text_of: Any,
                        offset: int) -> dict:
    """The legacy completions ``logprobs`` object; ``offset`` is the text offset so far."""
    tokens, values, tops, offsets = [], [], [], []
    for pos, tid in zip(positions, token_ids):
        tok, lp, top = _entries(pos or {}, tid, k, text_of)
        tokens.append(tok)
        values.append(lp)
        tops.append(dict(top))
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
