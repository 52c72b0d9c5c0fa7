"""Tool calls (``tools`` / ``tool_choice``) for chat templates that define them.

The tools go to the model's chat template as ``tools`` (it renders them in the model's own
format); the answer's text is parsed back into OpenAI ``tool_calls``, in the format the
template teaches the model (:func:`detect`):

- ``hermes`` (Qwen2.5 and other Hermes-style templates): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first call
  is the message's content.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole answer is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several joined by ``;``), optionally after
  ``<|python_tag|>``.

A template that mentions neither gets no tools: a request with tools is refused (400) rather
than silently answered without them. ``tool_choice``: ``auto`` (default) parses whatever the
model wrote; ``none`` renders no tools and parses nothing; ``required`` or a named function
also asks the grammar engine for output matching the call's JSON (a ``json_schema``
constraint over the tools' parameter schemas), so the answer is a call.
"""
from __future__ import annotations

from dataclasses import dataclass
import json
import re
import uuid

from gateway.openai.errors import bad

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def detect(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "parameters" in template:
        return "llama3_json"
    return None


@dataclass
class ToolSpec:
    """A request's tools as the template gets them, and how to read the answer."""
    tools: list[dict]
    fmt: str
    choice: str = "auto"  # auto | required | <function name>
    parallel: bool = True  # parallel_tool_calls: false makes "required" exactly one call


def _functions(tools) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise bad("tools must be a non-empty array", "tools")
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad("each tool must be {'type': 'function', 'function': {'name': ...}}",
                      "tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise bad(f"tool {f['name'][:60]!r}: parameters must be a JSON schema object",
                      "tools")
        out.append(t)
    return out


def tool_spec(body: dict, fmt: str | None) -> ToolSpec | None:
    """The request's tools (None: none, or ``tool_choice`` none)."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools is None or choice == "none":
        return None
    tools = _functions(tools)
    if fmt is None:
        raise bad("this model's chat template defines no tool calls", "tools")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice names no tool of the request", "tool_choice")
        choice = name
    elif choice not in ("auto", "required"):
        raise bad("tool_choice must be none, auto, required or a named function",
                  "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return ToolSpec(tools, fmt, choice, parallel)


def _call_schema(tool: dict) -> dict:
    f = tool["function"]
    return {"type": "object", "properties": {
        "name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"]}


def forced_schema(spec: ToolSpec) -> dict | None:
    """The JSON schema an answer must match when ``tool_choice`` forces a call: one call
    object for a named function, an array of at least one call for ``required`` (exactly
    one with ``parallel_tool_calls: false``)."""
    if spec.choice == "auto":
        return None
    if spec.choice != "required":
        tool = next(t for t in spec.tools if t["function"]["name"] == spec.choice)
        return _call_schema(tool)
    calls = {"type": "array", "minItems": 1,
             "items": {"anyOf": [_call_schema(t) for t in spec.tools]}}
    if not spec.parallel:
        calls["maxItems"] = 1
    return calls


def _call(obj) -> dict | None:
    """An OpenAI tool call from a parsed ``{"name", "arguments" | "parameters"}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse(text: str, spec: ToolSpec) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer; no call found: (text, [])."""
    if spec.choice != "auto":  # constrained to the call JSON
        obj = _json(text.strip())
        calls = [_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        return (None, calls) if calls and all(calls) else (text, [])
    if spec.fmt == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [_call(_json(m)) for m in _HERMES.findall(text[start:])]
        if not calls or not all(calls):
            return text, []
        return text[:start].strip() or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(_json(part)) for part in body.split(";") if part.strip()]
    return (None, calls) if calls and all(calls) else (text, [])


def releasable(text: str, spec: ToolSpec) -> int:
    """How much of a streamed answer's text so far may go out as content: all of it until
    a tool call may be starting; the rest waits for the end of the answer, where it is
    parsed whole. Never less than an earlier answer for a shorter prefix of ``text``."""
    if spec.choice != "auto":
        return 0
    if spec.fmt == "hermes":
        mark = "<tool_call>"
        at = text.find(mark)
        if at >= 0:
            return at
        for k in range(min(len(mark) - 1, len(text)), 0, -1):  # a marker cut by the chunking
            if text.endswith(mark[:k]):
                return len(text) - k
        return len(text)
    head = text.lstrip()
    if not head or head.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(head):
        return 0
    return len(text)


def content_end(text: str, spec: ToolSpec) -> int:
    """Where the content before an answer's tool calls ends (an answer parse found calls in)."""
    if spec.choice == "auto" and spec.fmt == "hermes":
        return max(text.find("<tool_call>"), 0)
    return 0


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects (what templates expect)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": _json(
                    c["function"].get("arguments") or "{}") or {}}} for c in calls]}
        out.append(m)
    return out
