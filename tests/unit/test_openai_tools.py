"""Tool calls of the OpenAI front (gateway/openai/tools.py): the format a chat template
teaches, tools rendered by the template, answers parsed back into tool_calls (whole and
streamed), the constraint a forced tool_choice asks for, and the grammar of tool_choice auto
(compiled by the engine's grammar engine over SmolLM2's tokenizer)."""
from __future__ import annotations

import json

import pytest

from engine.loader.tokenizer import ByteTokenizer
from gateway.openai import render, tools, translate
from gateway.openai.errors import ApiError
from protos.pdserve.v1 import common_pb2

# A Hermes-style template (the format of Qwen2.5's): tools listed in the system turn, calls
# as <tool_call>{json}</tool_call>, results as tool turns
HERMES = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA = ("{% if tools %}Respond with a JSON for a function call: {\"name\": function name, "
         "\"parameters\": dictionary}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
         "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}<|python_tag|>")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def job(fmt="hermes", **body):
    return translate.chat_job({"messages": MSGS, "tools": [WEATHER, TIME], **body}, ("m",),
                              "", 10.0, "", 100, fmt)


def test_formats_are_detected_from_the_template():
    assert tools.detect(HERMES) == "hermes" and tools.detect(LLAMA) == "llama3_json"
    assert tools.detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tools.detect(None) is None


def test_tools_reach_the_template_with_the_conversation():
    tok = ByteTokenizer()
    tok.chat_template = HERMES
    msgs = translate.messages({"messages": [
        *MSGS, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]})
    text = tok.decode(tok.encode_chat(msgs, tools=[WEATHER]))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    # the assistant's call, its arguments as an object, then the tool's result
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    assert "<tools>" not in tok.decode(tok.encode_chat(msgs))  # no tools: none rendered


def test_hermes_answers_parse_into_tool_calls():
    spec = job().tools
    content, calls = tools.parse('Let me check.\n<tool_call>\n{"name": "get_weather", '
                                 '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>'
                                 '{"name": "get_time", "arguments": {}}</tool_call>', spec)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert tools.parse("It is sunny.", spec) == ("It is sunny.", [])
    assert tools.parse("<tool_call>{not json}</tool_call>", spec)[1] == []  # stays text
    # an answer cut by EOS before the closing tag still parses
    assert tools.parse('<tool_call>{"name": "get_time", "arguments": {}}', spec)[1]


def test_llama3_json_answers_parse_into_tool_calls():
    spec = job("llama3_json").tools
    content, calls = tools.parse('<|python_tag|>{"name": "get_weather", "parameters": '
                                 '{"city": "Oslo"}}', spec)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, calls = tools.parse('{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                           '"parameters": {"city": "Rome"}}', spec)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert tools.parse("Hello!", spec) == ("Hello!", [])


def test_forced_tool_choice_asks_for_the_calls_json():
    named = job(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = json.loads(named.creq.sampling.constraint.json_schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    content, calls = tools.parse('{"name": "get_weather", "arguments": {"city": "Lima"}}',
                                 named.tools)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    req = job(tool_choice="required")
    schema = json.loads(req.creq.sampling.constraint.json_schema)
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    assert "maxItems" not in schema
    one = json.loads(job(tool_choice="required", parallel_tool_calls=False)
                     .creq.sampling.constraint.json_schema)
    assert one["maxItems"] == 1
    assert len(tools.parse('[{"name": "get_time", "arguments": {}}]', req.tools)[1]) == 1
    assert job(tool_choice="none").tools is None and job(tool_choice="none").creq.tools is None
    assert job().creq.sampling.constraint.grammar == tools.auto_grammar(job().tools)
    fmt = {"type": "json_object"}  # auto beside a response_format: the format constrains
    assert job(response_format=fmt).creq.sampling.constraint.json_object
    assert job().creq.tools == [WEATHER, TIME]


@pytest.mark.parametrize("body,fmt,param", [
    ({}, None, "tools"),  # a template without tools
    ({"tools": [{"type": "function"}]}, "hermes", "tools"),
    ({"tools": "x"}, "hermes", "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "hermes",
     "tool_choice"),
    ({"tool_choice": "sometimes"}, "hermes", "tool_choice"),
    *[({"tool_choice": {"type": "function", "function": f}}, "hermes", "tool_choice")
      for f in ("f", ["f"], {"name": ["f"]}, {"name": {}})],  # were 500s (fuzzing)
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "hermes",
     "tool_choice"),
])
def test_bad_tool_requests_are_400(body, fmt, param):
    with pytest.raises(ApiError) as e:
        job(fmt, **body)
    assert (e.value.status, e.value.param) == (400, param)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x"


def _stream(spec_job, pieces):
    ev = render.Events(spec_job, "r", 1, render.TokenText(_Tok()))
    out = []
    for k, text in enumerate(pieces):
        last = k == len(pieces) - 1
        resp = common_pb2.GenerateResponse(token_ids=[5], text=text,
                                           finish_reason="stop" if last else "")
        frame = json.loads(ev.frame(resp)[6:])
        out.append(frame["choices"][0])
    return out


def test_streamed_tool_calls_come_whole_at_the_end():
    j = job(stream=True)
    chunks = _stream(j, ["Sure. ", "<tool", "_call>{\"name\": \"get_time\", ", "\"arguments\": {}}",
                         "</tool_call>"])
    text = "".join(c["delta"].get("content") or "" for c in chunks)
    assert text == "Sure. "  # the call's text is held back, never streamed as content
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": "{}"}
    # no call after all: the held text comes out at the end
    chunks = _stream(job(stream=True), ["a <", "b"])
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "a <b"
    assert chunks[-1]["finish_reason"] == "stop"


def test_whole_answer_with_a_tool_call():
    j = job()
    a = render.Answer(j, "r", 1, render.TokenText(_Tok()))
    a.add(common_pb2.GenerateResponse(token_ids=[5], text='<tool_call>{"name": "get_weather", '
                                      '"arguments": {"city": "Paris"}}</tool_call>',
                                      finish_reason="stop"))
    (c,) = a.body()["choices"]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    assert c["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.fixture(scope="module")
def grammars():
    from engine.grammar import GrammarCompiler
    from engine.loader import load_tokenizer
    tok = load_tokenizer("smollm2-135m")
    return tok, GrammarCompiler(tok, 49152, tok.eos_token_ids)


def _admits(grammars, grammar: str, text: str) -> bool:
    """The answer ``text`` (then EOS) is one the grammar allows."""
    from engine import Constraint
    tok, compiler = grammars
    m = compiler.matcher(Constraint("grammar", grammar))
    return m.consume_all(tok.encode(text, add_special_tokens=False)) and m.accepting


CALL = '{"name":"get_weather","arguments":{"city":"Lima"}}'


@pytest.mark.parametrize("text,ok", [
    ("It is sunny in Lima, I think.", True),
    ("", True),
    ("a <b> c <tool", True),  # a marker's start is still text
    (f"<tool_call>{CALL}</tool_call>", True),
    (f"Let me look. <tool_call>\n{CALL}\n</tool_call>", True),
    (f'<tool_call>{CALL}</tool_call>\n<tool_call>{{"name":"get_time","arguments":{{}}}}'
     "</tool_call>", True),
    ('<tool_call>{"name":"get_weather","arguments":{}}</tool_call>', False),  # city required
    ('<tool_call>{"name":"book","arguments":{}}</tool_call>', False),  # no such tool
    ("<tool_call>sure, here it is</tool_call>", False),
    (f"<tool_call>{CALL}</tool_call> and some more text", False),
    (f"<tool_call>{CALL}", False),  # unterminated
])
def test_auto_tool_choice_lets_text_through_and_holds_calls_to_their_schema(grammars, text,
                                                                            ok):
    grammar = job().creq.sampling.constraint.grammar
    assert _admits(grammars, grammar, text) is ok
    if ok and "<tool_call>" in text:  # what the grammar admits, the parser reads back
        assert tools.parse(text, job().tools)[1]


def test_auto_tool_choice_single_call_and_llama3_json(grammars):
    one = job(parallel_tool_calls=False).creq.sampling.constraint.grammar
    assert _admits(grammars, one, f"<tool_call>{CALL}</tool_call>")
    assert not _admits(grammars, one, f"<tool_call>{CALL}</tool_call><tool_call>{CALL}"
                                      "</tool_call>")
    llama = job("llama3_json").creq.sampling.constraint.grammar
    call = '{"name":"get_weather","parameters":{"city":"Lima"}}'
    for text, ok in (("Paris is sunny.", True), (call, True), (f"{call};{call}", True),
                     ('{"name":"get_weather","parameters":{}}', False),
                     ('{"weather": "sunny"}', False), (f"{call} trailing", False)):
        assert _admits(grammars, llama, text) is ok, text
        if ok and text.startswith("{"):
            assert tools.parse(text, job("llama3_json").tools)[1]
