"""SmolLM2-135M with a chat template that defines tool calls, for the tool-call tests and
bench/tool_calls_cpu.py: SmolLM2's own template has no tools, so its weights and tokenizer
are saved as a Hugging Face folder with a Hermes-style template (the format of Qwen2.5's:
tools listed in the system turn, calls as ``<tool_call>{json}</tool_call>``)."""
from __future__ import annotations

import json

MODEL = "smollm2-135m"
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools>\nCall one as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FLIGHT = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"enum": ["economy", "business"]}},
        "required": ["origin", "destination", "passengers", "cabin"],
        "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
# one earlier turn in which the assistant called book_flight, then a new booking request:
# without such an example a 135M model almost never calls a tool
ONE_SHOT = [
    {"role": "user", "content": "Book one economy seat from Rome to Lima."},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "book_flight", "arguments": json.dumps(
                {"origin": "FCO", "destination": "LIM", "passengers": 1,
                 "cabin": "economy"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "booked"},
    {"role": "assistant", "content": "Done: one economy seat from Rome to Lima."},
    {"role": "user", "content": "Book two business seats from Paris to Oslo."}]


def save_hermes_folder(path: str) -> str:
    """SmolLM2-135M at ``path`` as a Hugging Face folder with the HERMES template."""
    from engine.loader import load_model, load_tokenizer
    from tests.reference import save_hf_folder
    tok = load_tokenizer(MODEL)
    save_hf_folder(load_model(MODEL, keep_packed=False), path,
                   tokenizer_json=tok.backend.to_str(),
                   tokenizer_config={"chat_template": HERMES, "eos_token": tok.eos_token,
                                     "bos_token": tok.bos_token})
    return path
