"""Constraints -> grammars -> per-sequence matchers, with llguidance as the grammar engine.

Why llguidance (bench/structured_cpu.py, docs/openai.md): compiling a schema takes about a
millisecond (xgrammar: tens to hundreds, it precomputes a token-mask cache per grammar), a
mask costs tens of microseconds per token on the 49,152-token SmolLM2 vocabulary, and the
wheel has no dependencies (xgrammar pulls transformers, pydantic and a TVM runtime).

- :class:`GrammarCompiler` (one per engine) turns a :class:`engine.request.Constraint`
  (kind, text) into a template matcher, checked and warmed once, and caches templates by
  (kind, text), least recently used out first. Errors (bad JSON, an unsupported schema, a
  bad regex or grammar, a grammar over the engine's limits) raise :class:`GrammarError`
  (a ValueError: workers answer INVALID_ARGUMENT with its message). The grammar engine's
  tokenizer is built from the engine's own (the tokenizer.json our loader built, from a
  GGUF or a Hugging Face folder; the byte tokenizer of dummy models from its 256 bytes), on
  first use.
- :class:`Matcher` is one sequence's state: a copy of the template, advanced by every token
  the sequence generates (on the prefill worker the first, on the decode worker the same
  first token again and then its own: a matcher is rebuilt from the tokens, never shipped).
- :func:`fill_bitmasks` writes the next-token masks of a step's constrained rows (in
  parallel on the grammar engine's threads); the sampler applies them.

JSON is generated compact (no whitespace between tokens: a small model would otherwise be
free to emit whitespace until max_tokens); a schema can ask otherwise through llguidance's
``x-guidance`` key.
"""
from __future__ import annotations

from collections import OrderedDict
import json
import logging
import threading

import torch

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "grammar")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message is safe to return."""


def _ll():
    import llguidance  # imported on the first constrained request only
    return llguidance


def _json_schema(text: str) -> str:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    except RecursionError:  # a few hundred nested levels in a 64 KiB schema
        raise GrammarError("json_schema is nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object (a JSON Schema)")
    try:
        return _ll().LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"json_schema: {e}") from None
    except RecursionError:
        raise GrammarError("json_schema is nested too deeply") from None


def grammar_of(kind: str, text: str) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    ll = _ll()
    if kind == "json_object":
        return _json_schema('{"type": "object"}')
    if kind == "json_schema":
        return _json_schema(text)
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(text)
    if kind == "grammar":
        try:  # Lark, or GBNF (llama.cpp's dialect, converted)
            return ll.grammar_from("grammar", text)
        except Exception as e:  # the GBNF converter raises its own types
            raise GrammarError(f"grammar: {str(e)[:300]}") from None
    raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


PROBE_STEPS = 4  # tokens a new grammar is walked at compile time (GrammarCompiler._probe)


def _short(message: str) -> str:
    """llguidance's error without the parser state it appends (``<state>...``): what a
    client is told."""
    return message.split("\n<state>", 1)[0].strip()[:300]


def _first_allowed(row: torch.Tensor, eos_ids) -> int | None:
    """The lowest token id a mask row allows, EOS aside (None: only EOS, or nothing)."""
    for w in row.nonzero().flatten().tolist():
        bits = int(row[w]) & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            tok = 32 * w + low.bit_length() - 1
            if tok not in eos_ids:
                return tok
            bits ^= low
    return None


class _ByteVocab:
    """What llguidance's TokenizerWrapper reads, for engine.loader's ByteTokenizer."""

    def __init__(self, tok, vocab_size: int):
        self.eos_token_id = tok.eos_token_ids[0]
        self.bos_token_id = tok.bos_token_id
        n = max(vocab_size, tok.vocab_size)
        self.tokens = [b"\xff[%d]" % i for i in range(n)]  # \xff: a special token
        for b in range(256):
            self.tokens[b + tok.OFFSET] = bytes([b])
        self.special_token_ids = [i for i in range(n) if not tok.OFFSET <= i < tok.OFFSET + 256]
        self._tok = tok

    def __call__(self, s):
        text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special_tokens=False)


def build_ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's tokenizer for ours (~0.8 s for a 49k vocabulary: built once)."""
    ll = _ll()
    eos = sorted(eos_ids) or None
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:  # engine.loader.tokenizer.Tokenizer: its tokenizers.Tokenizer
        return ll.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "OFFSET"):  # ByteTokenizer
        return ll.LLTokenizer(ll.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)),
                              n_vocab=vocab_size, eos_token=eos)
    raise GrammarError("structured output needs the model's tokenizer")


class Matcher:
    """One sequence's position in its constraint's grammar."""

    __slots__ = ("_m", "constraint")

    def __init__(self, ll_matcher, constraint):
        self._m = ll_matcher
        self.constraint = constraint

    def consume(self, token_id: int) -> bool:
        """Advance over a generated token; False: the token breaks the grammar (the matcher
        is then in error for good)."""
        return self._m.consume_token(token_id)

    def consume_all(self, token_ids) -> bool:
        return not token_ids or self._m.consume_tokens(list(token_ids))

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (but EOS): the answer ends."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def fill(self, row: torch.Tensor) -> None:
        """The next-token mask into ``row`` (int32, contiguous, on the CPU)."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


_executor = None
_executor_lock = threading.Lock()


def fill_bitmasks(matchers: list[Matcher], out: torch.Tensor) -> None:
    """Row i of ``out`` (int32 [len(matchers), ceil(V / 32)], CPU, contiguous) := the mask of
    ``matchers[i]`` (bit j of word w: token 32 w + j allowed). Several rows are computed in
    parallel by the grammar engine's thread pool (its Rust threads, outside the GIL)."""
    if len(matchers) == 1:
        matchers[0].fill(out[0])
        return
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = _ll().LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)],
                                      out.data_ptr(), out.shape[1] * 4, out.shape[0])


class GrammarCompiler:
    """Constraint -> Matcher for one engine (thread-safe: workers compile on a thread pool,
    the engine thread takes matchers from the cache)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = 256,
                 max_grammar_size: int = 500_000, lexer_fuel: int = 1_000_000):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.cache_size = cache_size
        self._limits = (max_grammar_size, lexer_fuel)
        self._ll_tok = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses), for tests and metrics

    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tok is None:
                self._ll_tok = build_ll_tokenizer(self.tokenizer, self.vocab_size,
                                                  self.eos_ids)
            return self._ll_tok

    def _build(self, kind: str, text: str):
        ll = _ll()
        grammar = grammar_of(kind, text)
        size, fuel = self._limits
        limits = ll.LLParserLimits(max_grammar_size=size, initial_lexer_fuel=fuel)
        m = ll.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=limits)
        if m.is_error():
            raise GrammarError(f"{kind}: {_short(m.get_error())}")
        mask = torch.empty((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        Matcher(m, None).fill(mask[0])  # warms the lexer; a grammar over limits fails here
        if m.is_error():
            raise GrammarError(f"{kind}: {_short(m.get_error())}")
        if not bool(mask.any()):
            raise GrammarError(f"{kind}: the grammar admits no token of this model")
        self._probe(kind, m.deep_copy(), mask)
        return m

    def _probe(self, kind: str, m, mask: torch.Tensor, steps: int = PROBE_STEPS) -> None:
        """Walk a copy of a new grammar a few tokens (the lowest allowed one that is not
        EOS, each step): a grammar whose lexer only blows past the engine's limits once it
        moves (``a{1000000}``: "too many expressions") is refused now, with its message,
        instead of breaking its request's first token."""
        for _ in range(steps):
            Matcher(m, None).fill(mask[0])
            if m.is_error():
                raise GrammarError(f"{kind}: {_short(m.get_error())}")
            tok = _first_allowed(mask[0], self.eos_ids)
            if tok is None or m.is_stopped():
                return
            if not m.consume_token(tok):
                raise GrammarError(f"{kind}: {_short(m.get_error())}")

    def compile(self, constraint) -> object:
        """The cached template for ``constraint`` (compiled now on a miss); GrammarError."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = self._build(*key)
            except GrammarError as e:
                hit = e
            with self._lock:
                self.compiles += 1
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def matcher(self, constraint) -> Matcher:
        """A fresh matcher at the start of ``constraint``'s grammar."""
        return Matcher(self.compile(constraint).deep_copy(), constraint)
