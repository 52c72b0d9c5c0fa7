"""Tool calls under ``tool_choice: auto`` (issue 25, point 5): how many sampled answers that
call a tool produce calls that parse and validate, with the auto grammar and without it.

    python3 -m bench.tool_calls_cpu --set cpu-mybox
    python3 -m bench.tool_calls_cpu --samples 8 --out /tmp/t.json  (quick)

SmolLM2-135M-Instruct (the embedded GGUF) saved as a Hugging Face folder with a Hermes-style
chat template (SmolLM2's own has none; tests/tool_fixtures.py), served colocated by a
LocalCluster (real processes, the OpenAI HTTP front, the official ``openai`` client). Each
request is the same conversation (``ONE_SHOT``): one earlier turn in which the assistant
called ``book_flight`` (without it a 135M model almost never calls), then a new booking
request, with two tools (``book_flight``: two airport codes by pattern, a passenger count 1-9, an enum cabin;
``get_weather``: a city of at most 20 characters). Sampled at temperature 1.0, seeds
0..N-1, 160 tokens at most.

- ``auto``: as served (the gateway's auto grammar: text, or calls held to their schemas).
- ``unconstrained``: the same requests with ``structured_outputs: {"regex": "(?s:.*)"}``,
  a constraint that admits everything; it takes the auto grammar's place (a request's own
  constraint wins over it), so the model samples freely, as before the grammar existed.

Per mode: answers that tried a call (``<tool_call>`` in the text, or parsed calls), answers
whose calls all parsed and validated (jsonschema), the broken ones (a call's text that does
not parse, names no tool, or fails its schema; cut by the token limit counted apart), and
answers in plain text.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from pdserve.benchlib import harness
from tests.tool_fixtures import FLIGHT, ONE_SHOT, WEATHER, save_hermes_folder

TOOLS = {t["function"]["name"]: t for t in (FLIGHT, WEATHER)}
FIGURES = [
    harness.Figure("auto grammar: call answers whose calls all validate", "%",
                   ("modes", "auto", "valid_pct"), format=".1f"),
    harness.Figure("unconstrained: call answers whose calls all validate", "%",
                   ("modes", "unconstrained", "valid_pct"), format=".1f"),
]
FREE = {"structured_outputs": {"regex": "(?s:.*)"}}


def _valid(calls) -> bool:
    import jsonschema
    for call in calls:
        tool = TOOLS.get(call.function.name)
        try:
            args = json.loads(call.function.arguments)
            if tool is None:
                return False
            jsonschema.validate(args, tool["function"]["parameters"])
        except (ValueError, jsonschema.ValidationError):
            return False
    return True


def _classify(choice) -> str:
    calls = choice.message.tool_calls or []
    text = choice.message.content or ""
    if not calls and "<tool_call>" not in text:
        return "text"
    if calls and _valid(calls):
        return "valid"
    return "cut" if choice.finish_reason == "length" else "broken"


def _mode(client, model: str, a, extra: dict) -> dict:
    counts = {"text": 0, "valid": 0, "broken": 0, "cut": 0}
    examples: dict[str, str] = {}
    t0 = time.perf_counter()
    for seed in range(a.samples):
        r = client.chat.completions.create(
            model=model, messages=ONE_SHOT, max_tokens=a.max_tokens, temperature=1.0,
            seed=seed, tools=[FLIGHT, WEATHER], extra_body=extra or None)
        kind = _classify(r.choices[0])
        counts[kind] += 1
        m = r.choices[0].message
        examples.setdefault(kind, (m.content or "") + json.dumps(
            [c.function.arguments for c in m.tool_calls or []])[:300])
    tried = counts["valid"] + counts["broken"] + counts["cut"]
    out = {**counts, "samples": a.samples, "tried_a_call": tried,
           "valid_pct": 100.0 * counts["valid"] / tried if tried else None,
           "wall_s": time.perf_counter() - t0, "examples": examples}
    print(out, flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.tool_calls_cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40, help="seeds per mode")
    ap.add_argument("--max-tokens", type=int, default=160)
    harness.add_output_args(ap, "tool_calls_cpu")
    a = ap.parse_args(argv)
    rec = harness.Recorder.start("tool_calls_cpu", a, argv=argv, about=__doc__,
                                 figures=FIGURES)
    import openai
    from pdserve.cluster import LocalCluster
    with tempfile.TemporaryDirectory() as tmp:
        with LocalCluster(save_hermes_folder(tmp), prefill=0, decode=0, colocated=1, http_port=0) as c:
            client = openai.OpenAI(base_url=f"http://{c.http_address}/v1", api_key="x",
                                   max_retries=0, timeout=600)
            model = client.models.list().data[0].id
            rec["modes"] = {"auto": _mode(client, model, a, {}),
                            "unconstrained": _mode(client, model, a, FREE)}
    print(f"wrote {rec.save()}")
    return rec.doc


if __name__ == "__main__":
    main()
