"""OpenAI-style chat messages -> the exact DeepSeek-V4 / V4.1 prompt text.

DeepSeek ships no Jinja template for V4; its prompt builders are Python
(``encoding/encoding_dsv4.py`` for V4, ``encoding/encoding.py`` for V4.1).  This module
implements the same format from the facts recorded in ``docs/CHAT_FORMAT.md``:

* ``bos``, then one rendering per message; a user turn is ``<｜User｜>text``; after the user
  turn that precedes an assistant turn (or ends the prompt) comes ``<｜Assistant｜>`` and
  ``<think>`` (thinking mode) or ``</think>`` (chat mode);
* an assistant turn is ``[reasoning</think>] content [\\n\\n<DSML block>] eos``;
* tool results are folded into the following user turn as ``<tool_result>…</tool_result>``
  blocks (joined by blank lines, ordered like the calls), tool schemas go into the leading
  system message under ``## Tools``;
* in thinking mode the reasoning of turns before the last user turn is dropped unless tools
  are in play;
* V4: a ``max`` reasoning effort adds a fixed paragraph at the very start; V4.1: a numeric
  budget line behind ``<｜System｜>``, a leading system message behind ``<｜System｜>``, and
  mid-conversation system messages of their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from dsv4.chat.format import (
    ASSISTANT,
    BOS,
    EOS,
    LATEST_REMINDER,
    SYSTEM,
    THINK_CLOSE,
    THINK_OPEN,
    USER,
    DsmlTags,
    check_variant,
    dsml_tags,
)

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

# V4: "max" is the only effort level with a prompt of its own (the others add nothing).
V4_MAX_EFFORT_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
V4_EFFORTS = ("low", "medium", "high", "max")

# V4.1: low / high / max are DeepSeek's aliases; "medium" (OpenAI's default level) maps to
# DeepSeek's default budget.
V41_EFFORT_ALIASES = {"low": 50, "medium": 75, "high": 75, "max": 100}
V41_DEFAULT_EFFORT = 75


def v41_effort_line(budget: int) -> str:
    """The V4.1 reasoning-budget line (rendered right after ``<｜System｜>``)."""
    return (f"Reasoning Effort: {budget} "
            "(range 1-100, the higher the value, the more thorough the reasoning)\n\n")


def tools_section(tags: DsmlTags, schemas: Sequence[dict]) -> str:
    """The ``## Tools`` section appended (after a blank line) to the system prompt."""
    b, i, p = tags.block_open, tags.invoke_start, tags.parameter_start
    lines = [
        "## Tools",
        "",
        "You have access to a set of tools to help answer the user's question. You can invoke "
        f"tools by writing a \"{b}\" block like the following:",
        "",
        b,
        f'{i} name="$TOOL_NAME">',
        f'{p} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{tags.parameter_close}',
        "...",
        tags.invoke_close,
        f'{i} name="$TOOL_NAME2">',
        "...",
        tags.invoke_close,
        tags.block_close,
        "",
        "String parameters should be specified as is and set `string=\"true\"`. For all other "
        "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
        "`string=\"false\"`.",
        "",
        f"If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete "
        f"reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.",
        "",
        f"Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.",
        "",
        "### Available Tool Schemas",
        "",
        "\n".join(_json(s) for s in schemas),
        "",
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
        "tool calls.",
        "",
    ]
    return "\n".join(lines)


def render_tool_calls(tags: DsmlTags, calls: Sequence[tuple[str, dict]]) -> str:
    """A DSML block for ``calls`` (name, arguments dict), with its leading blank line."""
    invokes = []
    for name, args in calls:
        params = "\n".join(
            f'{tags.parameter_start} name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}{tags.parameter_close}"
            for key, v in args.items())
        invokes.append(f'{tags.invoke_start} name="{name}">\n{params}\n{tags.invoke_close}')
    return "\n\n" + tags.block_open + "\n" + "\n".join(invokes) + "\n" + tags.block_close


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------------ validated message model
@dataclass
class _Turn:
    role: str
    text: str = ""
    # user turns: ("text", s) or ("tool_result", s, tool_call_id)
    blocks: list[tuple] = field(default_factory=list)
    reasoning: str = ""
    tool_calls: list[tuple[str, dict, str]] = field(default_factory=list)  # name, args, id
    tools: list[dict] = field(default_factory=list)


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _text_of(value: Any, where: str, *, allow_none: bool) -> str:
    """Content as a string: str, or a list of text parts joined by blank lines."""
    if value is None:
        if allow_none:
            return ""
        raise ValueError(f"{where}: required, found null")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"{where}[{j}]: expected a content part object, found {_kind(part)}")
            kind = part.get("type")
            if kind != "text":
                if kind in ("image_url", "image", "input_image"):
                    raise ValueError(f"{where}[{j}].type: image input is not supported")
                raise ValueError(f"{where}[{j}].type: expected 'text', found {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}[{j}].text: expected a string, found {_kind(text)}")
            texts.append(text)
        return "\n\n".join(texts)
    raise ValueError(f"{where}: expected a string or a list of text parts, found {_kind(value)}")


def _arguments_of(raw: Any, where: str) -> dict:
    """Tool-call arguments as a dict (a JSON string, even double-encoded, or a dict)."""
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise ValueError(f"{where}: expected a JSON string or an object, found {_kind(raw)}")
    value: Any = raw
    for _ in range(2):  # tolerate a double-encoded JSON string
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    # Not a JSON object: keep the raw text as one string parameter (the reference does too).
    return value if isinstance(value, dict) else {"arguments": raw}


def _tool_calls_of(value: Any, where: str) -> list[tuple[str, dict, str]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list, found {_kind(value)}")
    calls = []
    for j, tc in enumerate(value):
        w = f"{where}[{j}]"
        if not isinstance(tc, dict):
            raise ValueError(f"{w}: expected an object, found {_kind(tc)}")
        if tc.get("type", "function") != "function":
            raise ValueError(f"{w}.type: expected 'function', found {tc.get('type')!r}")
        fn = tc.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{w}.function: expected an object, found {_kind(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{w}.function.name: expected a non-empty string, found {name!r}")
        args = _arguments_of(fn.get("arguments", "{}"), f"{w}.function.arguments")
        call_id = tc.get("id") or fn.get("id") or ""
        if not isinstance(call_id, str):
            raise ValueError(f"{w}.id: expected a string, found {_kind(call_id)}")
        calls.append((name, args, call_id))
    return calls


def _turns_of(messages: Any, variant: str) -> list[_Turn]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages: expected a non-empty list, found {messages!r:.60}")
    turns = []
    for i, msg in enumerate(messages):
        w = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{w}: expected an object, found {_kind(msg)}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{w}.role: expected one of {', '.join(ROLES)}; found {role!r}")
        if role == "developer" and variant == "v41":
            role = "system"  # V4.1 has no developer role; OpenAI's developer == system
        if role != "assistant" and "content" not in msg:
            raise ValueError(f"{w}.content: required for role {role!r}")
        t = _Turn(role=role)
        if role == "assistant":
            t.text = _text_of(msg.get("content"), f"{w}.content", allow_none=True)
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{w}.reasoning_content: expected a string, found {_kind(reasoning)}")
            t.reasoning = reasoning or ""
            t.tool_calls = _tool_calls_of(msg.get("tool_calls"), f"{w}.tool_calls")
        elif role == "tool":
            call_id = msg.get("tool_call_id") or ""
            if not isinstance(call_id, str):
                raise ValueError(f"{w}.tool_call_id: expected a string, found {_kind(call_id)}")
            t.blocks = [("tool_result", _text_of(msg["content"], f"{w}.content", allow_none=False),
                         call_id)]
        elif role == "user":
            t.blocks = [("text", _text_of(msg["content"], f"{w}.content", allow_none=False))]
        else:
            t.text = _text_of(msg["content"], f"{w}.content", allow_none=role != "developer")
            if role == "developer" and not t.text:
                raise ValueError(f"{w}.content: must not be empty for role 'developer'")
        turns.append(t)
    return turns


def _tool_schemas(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools: expected a list, found {_kind(tools)}")
    schemas = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}]: expected an object, found {_kind(tool)}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type: expected 'function', found {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}].function: expected an object, found {_kind(fn)}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name: expected a non-empty string, "
                             f"found {fn.get('name')!r}")
        schemas.append(fn)
    return schemas


def _effort_prefix(variant: str, effort: Any, thinking: bool) -> str:
    """The text rendered before message 0 for ``effort`` (validated even in chat mode)."""
    if variant == "v4":
        if effort is not None and effort not in V4_EFFORTS:
            raise ValueError(f"reasoning_effort: expected one of {', '.join(V4_EFFORTS)} for V4; "
                             f"found {effort!r}")
        return V4_MAX_EFFORT_PREFIX if thinking and effort == "max" else ""
    if effort is None:
        budget = V41_DEFAULT_EFFORT
    elif isinstance(effort, str) and effort in V41_EFFORT_ALIASES:
        budget = V41_EFFORT_ALIASES[effort]
    elif type(effort) is int and 1 <= effort <= 100:  # bool is not a budget
        budget = effort
    else:
        raise ValueError("reasoning_effort: expected an integer 1-100 or one of "
                         f"{', '.join(V41_EFFORT_ALIASES)}; found {effort!r}")
    return v41_effort_line(budget) if thinking else ""


# ------------------------------------------------------------------ preprocessing
def _fold_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """Tool results and consecutive user messages become one user turn of blocks; tool
    results are ordered like the calls of the latest assistant turn with tool calls."""
    folded: list[_Turn] = []
    for t in turns:
        if t.role in ("user", "tool"):
            if folded and folded[-1].role == "user":
                folded[-1].blocks.extend(t.blocks)
            else:
                folded.append(_Turn(role="user", blocks=list(t.blocks)))
        else:
            folded.append(t)
    call_order: dict[str, int] = {}
    for t in folded:
        if t.role == "assistant" and t.tool_calls:
            call_order = {cid: k for k, (_, _, cid) in enumerate(t.tool_calls) if cid}
        elif t.role == "user" and call_order:
            results = [b for b in t.blocks if b[0] == "tool_result"]
            if len(results) > 1:
                ordered = iter(sorted(results, key=lambda b: call_order.get(b[2], 0)))
                t.blocks = [next(ordered) if b[0] == "tool_result" else b for b in t.blocks]
    return folded


def _opens_assistant(t: _Turn, index: int, variant: str) -> bool:
    """Whether an assistant header follows this turn (it counts as a 'user' turn)."""
    if t.role == "user":
        return True
    if variant == "v4":
        return t.role == "developer"
    return t.role == "system" and index > 0


def _last_user_index(turns: list[_Turn], variant: str) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if _opens_assistant(turns[i], i, variant):
            return i
    return -1


# ------------------------------------------------------------------ rendering
def encode_messages(messages: Sequence[dict], *, variant: str = "v4", thinking: bool = False,
                    reasoning_effort: str | int | None = None, tools: Sequence[dict] | None = None,
                    add_generation_prompt: bool = True, drop_thinking: bool = True) -> str:
    """Render OpenAI-style ``messages`` as the prompt text of a DeepSeek-V4 (``"v4"``) or
    V4.1 (``"v41"``) model, starting with the BOS token.

    ``thinking`` selects thinking mode (the assistant header ends with ``<think>``) over chat
    mode (``</think>``).  ``reasoning_effort``: V4 accepts low/medium/high/max (only max
    changes the prompt); V4.1 accepts an integer 1-100 or low/medium/high/max (50/75/75/100).
    ``tools`` are OpenAI function tools; they are rendered into the leading system message
    (one is inserted when the conversation has none).  ``add_generation_prompt=False`` leaves
    the assistant header off the end.  ``drop_thinking`` (default on, forced off when tools
    are given) drops the reasoning of assistant turns before the last user turn.

    Raises ValueError naming the message index and field for malformed input.
    """
    check_variant(variant)
    if not isinstance(thinking, bool):
        raise ValueError(f"thinking: expected a boolean, found {_kind(thinking)}")
    tags = dsml_tags(variant)
    turns = _turns_of(messages, variant)
    schemas = _tool_schemas(tools)
    effort_prefix = _effort_prefix(variant, reasoning_effort, thinking)
    turns = _fold_tool_results(turns)
    if schemas:
        if turns[0].role != "system":
            turns.insert(0, _Turn(role="system"))
        turns[0].tools = schemas
    keep_reasoning = not drop_thinking or bool(schemas)
    if thinking and not keep_reasoning:
        last = _last_user_index(turns, variant)
        # developer instructions before the last user turn are dropped with the old reasoning
        turns = [t for i, t in enumerate(turns) if i >= last or t.role != "developer"]

    last_user = _last_user_index(turns, variant)
    out = [BOS]
    for i, t in enumerate(turns):
        if i == 0:
            if variant == "v41" and (effort_prefix or t.role == "system"):
                out.append(SYSTEM)
            out.append(effort_prefix)
        out.append(_render_turn(t, i, variant, tags, thinking, keep_reasoning, last_user))
        nxt = turns[i + 1] if i + 1 < len(turns) else None
        if nxt is not None and nxt.role not in ("assistant", "latest_reminder"):
            continue
        if _opens_assistant(t, i, variant) and (nxt is not None or add_generation_prompt):
            opens_thinking = thinking and (keep_reasoning or i >= last_user)
            out.append(ASSISTANT + (THINK_OPEN if opens_thinking else THINK_CLOSE))
    return "".join(out)


def _render_turn(t: _Turn, i: int, variant: str, tags: DsmlTags, thinking: bool,
                 keep_reasoning: bool, last_user: int) -> str:
    tools = "\n\n" + tools_section(tags, t.tools) if t.tools else ""
    if t.role == "system":
        return (SYSTEM if variant == "v41" and i > 0 else "") + t.text + tools
    if t.role == "developer":
        return USER + t.text + tools
    if t.role == "latest_reminder":
        return LATEST_REMINDER + t.text
    if t.role == "user":
        return USER + "\n\n".join(
            b[1] if b[0] == "text" else f"<tool_result>{b[1]}</tool_result>" for b in t.blocks)
    # assistant
    head = ""
    if thinking and (keep_reasoning or i > last_user):
        head = t.reasoning + THINK_CLOSE
    calls = render_tool_calls(tags, [(n, a) for n, a, _ in t.tool_calls]) if t.tool_calls else ""
    return head + t.text + calls + EOS
