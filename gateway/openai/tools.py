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
than silently answered without them. ``tool_choice``:

- ``auto`` (default): the model may answer in text or call tools; the grammar engine lets
  text through and, once a call begins, holds it to its tool's schema (:func:`auto_grammar`:
  a Lark grammar, free text up to the first ``<tool_call>``, then calls only; in the
  ``llama3_json`` format an answer that starts with ``{`` is a call). With a
  ``response_format`` as well, that constraint applies instead and calls are only parsed.
- ``required`` or a named function: output matching the call's JSON (a ``json_schema``
  constraint over the tools' parameter schemas), so the answer is a call.
- ``none``: renders no tools and parses nothing.

Calls are generated as compact JSON, like every JSON constraint (engine.grammar).
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
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str):
            raise bad("tool_choice must be {'type': 'function', 'function': {'name': ...}}",
                      "tool_choice")
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


def _call_schema(tool: dict, args_key: str = "arguments") -> dict:
    f = tool["function"]
    return {"type": "object", "properties": {
        "name": {"const": f["name"]}, args_key: f.get("parameters") or {"type": "object"}},
        "required": ["name", args_key], "additionalProperties": False}


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


_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _any_call(spec: ToolSpec, args_key: str) -> str:
    """One call object of any of the request's tools, as a Lark ``%json`` body."""
    calls = [_call_schema(t, args_key) for t in spec.tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


def auto_grammar(spec: ToolSpec) -> str | None:
    """The Lark grammar (llguidance's dialect) of an answer under ``tool_choice: auto``:
    text, or calls whose JSON matches their tool's schema (module docstring). The text
    lexeme excludes the call marker, so a marker always starts a constrained call; a lazy
    rule ends the text before the first marker (greedy lexing would read past it)."""
    if spec.choice != "auto":
        return None
    call = _any_call(spec, "arguments" if spec.fmt == "hermes" else "parameters")
    if spec.fmt == "hermes":
        more = '(WS? "<tool_call>" call)* WS?' if spec.parallel else "WS?"
        return "\n".join([
            "%llguidance {}",
            "start: TEXT | head call more",
            r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
            r'head[lazy]: /(?s:.*)/ "<tool_call>"',
            'call: WS? body WS? "</tool_call>"',
            f"more: {more}",
            r"WS: /[ \t\r\n]+/",
            f"body: {call}", ""])
    more = '(";" WS? body)* WS?' if spec.parallel else "WS?"
    return "\n".join([  # llama3_json: text must not open with "{"
        "%llguidance {}",
        "start: TEXT | WS? body more",
        r"TEXT: /(?s:\s*([^\s{].*)?)/",
        r"WS: /[ \t\r\n]+/",
        f"more: {more}",
        f"body: {call}", ""])


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
    except (TypeError, ValueError, RecursionError):  # not text, not JSON, nested too deep
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


def _template_call(c, where: str) -> dict:
    """One assistant tool call of the conversation, its arguments as an object."""
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad(f"{where}: each call must be {{'function': {{'name': ..., 'arguments': "
                  "...}}}}", where)
    args = f.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):  # what the model wrote earlier, echoed back: kept as it is
        parsed = _json(args)  # when it is not JSON (the template then shows the text)
        args = args if parsed is None else parsed
    elif not isinstance(args, dict):
        raise bad(f"{where}: arguments must be a JSON text (or an object)", where)
    return {**c, "function": {**f, "arguments": args}}


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects (what templates expect);
    malformed calls are refused (400) here, not inside the template."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        where = f"messages[{i}].tool_calls"
        if calls is not None and not isinstance(calls, list):
            raise bad(f"{where} must be an array", where)
        if calls:
            m = {**m, "tool_calls": [_template_call(c, where) for c in calls]}
        for key in ("tool_call_id", "name"):
            if key in m and not isinstance(m[key], str):
                raise bad(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
        out.append(m)
    return out
