"""Benchmark workloads: deterministic lists of requests, saved and replayed as JSON lines.

A workload is a list of :class:`Item`. Each item carries exactly one of ``prompt`` (text),
``token_ids`` or ``messages`` (chat), and the number of tokens to generate; generation always
sets ``ignore_eos`` so output lengths are what the workload says. The same ``seed`` always
gives the same items (``random.Random(seed)`` only, never the global generator).

Kinds:

- ``random``: prompt and output lengths uniform in the given ranges.
- ``prefix``: N shared system prompts x M users; every request is one system prompt followed
  by its user's own question, so a prefix cache can serve the system part.
- ``multiturn``: conversations whose turn k's prompt is turn k-1's prompt, a fixed synthetic
  assistant reply and a new user message; turns of different conversations interleave.
- ``longmix``: ``random`` with a fraction of requests given a long prompt.

Prompt lengths are counted in *units*: token ids when ``fmt == "tokens"``, words otherwise
(the tokenizer decides how many tokens a word is; a word of the built-in list is usually one
or two tokens for BPE vocabularies, ~6 for a byte tokenizer).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
import json
import random

# A small vocabulary of ordinary English words; prompts are sequences of them.
WORDS = """time person year way day thing man world life hand part child eye woman place work
week case point government company number group problem fact river garden window table paper
music story money water light city house road market school family question answer system
program idea reason level office door health art war history party result change morning
evening summer winter island mountain forest ocean bridge train letter friend teacher doctor
student computer engine network signal memory model token cache block server client request
simple quick bright quiet heavy gentle early late small large green blue yellow ancient modern
careful useful strange clear open close build carry follow learn measure notice offer rest
travel visit watch write read explain describe compare remember""".split()


@dataclass
class Item:
    id: str
    max_tokens: int
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None
    prompt_units: int = 0  # words or token ids in the prompt, as generated
    group: str = ""  # system prompt / conversation the item belongs to ("" if none)
    extra: dict = field(default_factory=dict)  # e.g. {"turn": 2}; free-form

    def to_json(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v not in (None, "", {})}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "Item":
        return cls(**json.loads(line))


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "random"  # random | prefix | multiturn | longmix
    num_requests: int = 100
    seed: int = 0
    fmt: str = "text"  # text | tokens
    vocab_size: int = 32000  # token ids are drawn from [10, vocab_size)
    input_len: tuple[int, int] = (32, 128)  # prompt units, inclusive range
    output_len: tuple[int, int] = (32, 32)  # generated tokens, inclusive range
    num_prefixes: int = 4  # prefix: shared system prompts
    num_users: int = 8  # prefix: distinct users (questions) per system prompt
    prefix_len: int = 256  # prefix: units in each system prompt
    num_turns: int = 4  # multiturn: turns per conversation
    reply_len: int = 32  # multiturn: units of the synthetic assistant reply
    long_frac: float = 0.2  # longmix: fraction of long prompts
    long_len: int = 1024  # longmix: units in a long prompt

    def __post_init__(self):
        if self.kind not in ("random", "prefix", "multiturn", "longmix"):
            raise ValueError(f"unknown workload kind {self.kind!r}")
        if self.fmt not in ("text", "tokens"):
            raise ValueError(f"unknown prompt format {self.fmt!r}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {lo}..{hi}")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")


class _Gen:
    def __init__(self, spec: WorkloadSpec):
        self.spec = spec
        self.rng = random.Random(spec.seed)

    def units(self, n: int):
        s = self.spec
        if s.fmt == "tokens":
            return [self.rng.randrange(10, s.vocab_size) for _ in range(n)]
        return [self.rng.choice(WORDS) for _ in range(n)]

    def length(self, rng_range: tuple[int, int]) -> int:
        return self.rng.randint(*rng_range)

    def item(self, i: int, units: list, max_tokens: int, **kw) -> Item:
        if self.spec.fmt == "tokens":
            return Item(f"r{i}", max_tokens, token_ids=list(units), prompt_units=len(units), **kw)
        return Item(f"r{i}", max_tokens, prompt=" ".join(units), prompt_units=len(units), **kw)


def _random(g: _Gen, long_frac: float = 0.0) -> list[Item]:
    s, out = g.spec, []
    for i in range(s.num_requests):
        long = long_frac > 0 and g.rng.random() < long_frac
        n = s.long_len if long else g.length(s.input_len)
        out.append(g.item(i, g.units(n), g.length(s.output_len),
                          extra={"long": True} if long else {}))
    return out


def _prefix(g: _Gen) -> list[Item]:
    s = g.spec
    systems = [g.units(s.prefix_len) for _ in range(s.num_prefixes)]
    users = [[g.units(g.length(s.input_len)) for _ in range(s.num_users)] for _ in systems]
    out = []
    for i in range(s.num_requests):
        p, u = g.rng.randrange(s.num_prefixes), g.rng.randrange(s.num_users)
        out.append(g.item(i, systems[p] + users[p][u], g.length(s.output_len),
                          group=f"sys{p}", extra={"user": u}))
    return out


def _multiturn(g: _Gen) -> list[Item]:
    s = g.spec
    num_conv = -(-s.num_requests // s.num_turns)
    history = [[] for _ in range(num_conv)]  # chat messages so far, per conversation
    turn = [0] * num_conv
    out = []
    for i in range(s.num_requests):
        live = [c for c in range(num_conv) if turn[c] < s.num_turns]
        c = g.rng.choice(live)
        if turn[c]:
            reply = g.units(s.reply_len)
            history[c].append({"role": "assistant", "ids": reply} if s.fmt == "tokens" else
                              {"role": "assistant", "content": " ".join(reply)})
        question = g.units(g.length(s.input_len))
        if s.fmt == "tokens":  # no chat template for raw ids: concatenate the turns
            history[c].append({"role": "user", "ids": question})
            ids = [t for m in history[c] for t in (m.get("ids") or [])]
            item = Item(f"r{i}", g.length(s.output_len), token_ids=ids, prompt_units=len(ids))
        else:
            history[c].append({"role": "user", "content": " ".join(question)})
            msgs = [dict(m) for m in history[c]]
            units = sum(len(m["content"].split()) for m in msgs)
            item = Item(f"r{i}", g.length(s.output_len), messages=msgs, prompt_units=units)
        item.group, item.extra = f"conv{c}", {"turn": turn[c]}
        turn[c] += 1
        out.append(item)
    return out


def parse_range(text: str) -> tuple[int, int]:
    """``"LO:HI"`` -> ``(LO, HI)``; ``"N"`` -> ``(N, N)`` (lengths drawn uniformly in it)."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def generate(spec: WorkloadSpec) -> list[Item]:
    g = _Gen(spec)
    if spec.kind == "random":
        return _random(g)
    if spec.kind == "longmix":
        return _random(g, spec.long_frac)
    if spec.kind == "prefix":
        return _prefix(g)
    return _multiturn(g)


def save(items: list[Item], path: str) -> None:
    with open(path, "w") as f:
        for it in items:
            f.write(it.to_json() + "\n")


def load(path: str) -> list[Item]:
    with open(path) as f:
        return [Item.from_json(line) for line in f if line.strip()]
