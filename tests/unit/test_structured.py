"""Structured output on the CPU: the grammar compiler and matcher wrapper (engine.grammar,
llguidance over SmolLM2's own tokenizer and the dummy models' byte tokenizer), the sampler's
bitmask (only constrained rows change), the engine's stop at the grammar's end, and
resuming a constrained request from tokens generated elsewhere."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import Constraint, SamplingParams
from engine.grammar import GrammarCompiler, GrammarError, fill_bitmasks
from engine.layers.sampler import Sampler, SamplingBatch
from engine.loader import ByteTokenizer, load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
    "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, 49152, tok.eos_token_ids, cache_size=4)


def allowed(mask_row: torch.Tensor, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def test_matcher_follows_a_schema_and_ends_at_its_close(compiler, tok):
    m = compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    text = '{"name":"Bo","age":42,"pet":"dog"}'
    ids = tok.encode(text, add_special_tokens=False)
    mask = torch.empty((1, 49152 // 32), dtype=torch.int32)
    for i, t in enumerate(ids):
        fill_bitmasks([m], mask)
        assert allowed(mask[0], t)
        assert not m.done
        assert m.consume(t)
    assert m.done and m.accepting
    fill_bitmasks([m], mask)
    assert allowed(mask[0], tok.eos_token_ids[0])  # only EOS may follow
    assert int(mask.ne(0).sum()) == 1


def test_mask_forbids_what_the_schema_forbids(compiler, tok):
    m = compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    mask = torch.empty((1, 49152 // 32), dtype=torch.int32)
    fill_bitmasks([m], mask)
    # (the forced start '{"name":"' is allowed as its canonical tokens)
    for text, ok in (('{"', True), ("[", False), ("hello", False), (" ", False)):
        t, = tok.encode(text, add_special_tokens=False)
        assert allowed(mask[0], t) is ok, text
    assert not allowed(mask[0], tok.eos_token_ids[0])  # an empty answer is not a document
    wrong = tok.encode('{"age"', add_special_tokens=False)  # name comes first
    assert not m.consume_all(wrong) and m.error


def test_bad_constraints_raise_short_grammar_errors(compiler):
    for c, words in ((Constraint("json_schema", "{not json"), "not valid JSON"),
                     (Constraint("json_schema", '{"type": "objectx"}'), "objectx"),
                     (Constraint("json_schema", "[1]"), "must be a JSON object"),
                     (Constraint("regex", "a[("), "unclosed character class"),
                     (Constraint("grammar", "start: nothing_defined"), "nothing_defined"),
                     # past the lexer's limits only once it moves: the compile-time walk
                     # refuses it (it used to break its request's first token: a 200 with
                     # finish_reason abort)
                     (Constraint("regex", "a{1000000}"), "too many expressions"),
                     (Constraint("json_schema", '{"$ref": "#"}'), "json_schema"),
                     # found by a failure hunt: a RecursionError reached gRPC (UNKNOWN),
                     # and the gateway retried it on every worker
                     *((Constraint("json_schema", open_ * 990 + "{}" + close * 990),
                        "nested too deeply|json_schema")
                       for open_, close in (('{"type":"array","items":', "}"),
                                            ('{"anyOf":[', "]}"),
                                            ('{"type":"object","properties":{"a":', "}}")))):
        with pytest.raises(GrammarError, match=words) as e:
            compiler.matcher(c)
        assert len(str(e.value)) <= 320 and "<state>" not in str(e.value)
    with pytest.raises(ValueError):
        Constraint("yaml", "x")
    with pytest.raises(ValueError):
        Constraint("regex", "")


def test_compiled_grammars_are_cached_by_kind_and_text(tok):
    c = GrammarCompiler(tok, 49152, tok.eos_token_ids, cache_size=2)
    a, b, d = (Constraint("regex", "a+"), Constraint("regex", "b+"), Constraint("grammar", "b+"))
    with pytest.raises(GrammarError):
        c.compile(d)  # a Lark grammar needs rules: same text, other kind, other entry
    c.compile(a), c.compile(a), c.compile(b)
    assert c.compiles == 3
    m1, m2 = c.matcher(a), c.matcher(a)  # independent copies of one template
    t, = tok.encode("a", add_special_tokens=False)
    assert m1.consume(t) and not m1.done
    assert m2.consume(t)
    c.compile(Constraint("json_object"))  # evicts the least recently used (b)
    c.compile(a)
    assert c.compiles == 4
    c.compile(b)
    assert c.compiles == 5


def test_byte_tokenizer_of_dummy_models():
    bt = ByteTokenizer()
    c = GrammarCompiler(bt, 512, bt.eos_token_ids)
    m = c.matcher(Constraint("regex", "(yes|no)"))
    mask = torch.empty((1, 16), dtype=torch.int32)
    fill_bitmasks([m], mask)
    ok = [i for i in range(512) if allowed(mask[0], i)]
    assert ok == [ord("n") + bt.OFFSET, ord("y") + bt.OFFSET]
    assert m.consume_all(bt.encode("no", add_special_tokens=False)) and m.done


class _Seq:
    def __init__(self, sp, matcher=None):
        self.sampling, self.matcher = sp, matcher
        self.token_ids, self.num_prompt_tokens = [1, 2], 2


def test_sampler_masks_only_constrained_rows(compiler, tok):
    torch.manual_seed(0)
    logits = torch.randn(4, 49152)
    sp = SamplingParams(temperature=0)
    csp = SamplingParams(temperature=0, constraint=Constraint("regex", "(yes|no)"))
    m = compiler.matcher(csp.constraint)
    seqs = [_Seq(sp), _Seq(csp, m), _Seq(sp), _Seq(csp, compiler.matcher(csp.constraint))]
    batch = SamplingBatch.from_seqs(seqs, [None] * 4, (2,))
    assert [r for r, _ in batch.masks] == [1, 3] and not batch.plain
    scores = Sampler.process(logits, batch)
    assert torch.equal(scores[0], logits[0]) and torch.equal(scores[2], logits[2])
    finite = [torch.isfinite(scores[r]).nonzero().view(-1).tolist() for r in (1, 3)]
    assert finite[0] == finite[1] and len(finite[0]) >= 2
    assert all(tok.decode([t]) and ("yes".startswith(tok.decode([t]))
                                    or "no".startswith(tok.decode([t]))) for t in finite[0])
    out = Sampler(torch.Generator()).__call__(logits, batch).to_host()[0]
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[1] in finite[0] and out[3] in finite[0]
    plain = SamplingBatch.from_seqs([_Seq(sp), _Seq(sp)], [None] * 2, (2,))
    assert plain.masks == [] and plain.plain  # no constrained row: nothing to do


@pytest.fixture(scope="module")
def engine():
    from engine.engine import LLMEngine
    from engine.llm import build_engine_config
    return LLMEngine(build_engine_config("smollm2-135m", max_num_seqs=8))


def _run(engine, rid):
    text, outs = "", []
    while engine.has_work:
        for o in engine.step():
            if o.request_id == rid:
                outs.append(o)
                text += o.text
    return text, outs


def test_engine_answers_validate_and_stop_with_the_grammar(engine, tok):
    sp = SamplingParams(max_tokens=60, temperature=0,
                        constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    prompt = tok.encode("A person as JSON:")
    engine.add_request("c", prompt, sp)
    engine.add_request("u", prompt, SamplingParams(max_tokens=5, temperature=0))
    text, outs = _run(engine, "c")
    jsonschema.validate(json.loads(text), SCHEMA)
    assert outs[-1].finish_reason.value == "stop"
    # resumed after 3 tokens generated elsewhere: the matcher is rebuilt from them and the
    # answer continues identically (greedy)
    ids = [t for o in outs for t in o.token_ids]
    engine.add_request("r", prompt, sp, output_token_ids=ids[:3])
    rest, routs = _run(engine, "r")
    assert ids[:3] + [t for o in routs for t in o.token_ids] == ids
    with pytest.raises(ValueError, match="do not match the constraint"):
        engine.add_request("x", prompt, sp, output_token_ids=tok.encode("[", add_special_tokens=False))


def test_constrained_requests_free_their_blocks_on_every_end(engine, tok):
    """A constrained request aborted mid-decode (n = 2 samples sharing the prompt's blocks),
    one cut by max_tokens inside the grammar and one the grammar ends: each leaves no KV
    block and no sequence behind, and a plain request afterwards runs as before."""
    bm = engine.scheduler.bm
    free0 = bm.num_free_blocks
    sp = SamplingParams(max_tokens=60, temperature=0.8, seed=3, n=2,
                        constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    prompt = tok.encode("A person as JSON:")
    engine.add_request("abort-me", prompt, sp)
    for _ in range(4):
        engine.step()
    assert bm.num_free_blocks < free0  # the prompt's and both samples' blocks are taken
    assert engine.abort("abort-me")
    cut = SamplingParams(max_tokens=3, temperature=0,
                         constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    engine.add_request("cut", prompt, cut)
    _, outs = _run(engine, "cut")
    assert outs[-1].finish_reason.value == "length"
    whole = SamplingParams(max_tokens=60, temperature=0,
                           constraint=Constraint("regex", "(yes|no)"))
    engine.add_request("whole", prompt, whole)
    text, outs = _run(engine, "whole")
    assert text in ("yes", "no") and outs[-1].finish_reason.value == "stop"
    assert not engine.has_work and not engine.scheduler.requests
    assert bm.num_free_blocks == free0
    engine.add_request("plain", prompt, SamplingParams(max_tokens=4, temperature=0))
    _, outs = _run(engine, "plain")
    assert sum(len(o.token_ids) for o in outs) == 4
