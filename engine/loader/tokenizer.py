"""Tokenizers and chat templates. Torch-free: the gateway imports this module.

`Tokenizer` wraps a `tokenizers.Tokenizer` (from an HF tokenizer.json, or built from GGUF
metadata by `gguf_tokenizer.py`) plus what the engine needs beside it: bos / eos ids and a Jinja
chat template rendered in a sandbox. `ByteTokenizer` has the same interface for dummy models:

    id 0 = <pad>, 1 = <bos>, 2 = <eos>, byte b = b + 3; any other id decodes to nothing.

Its chat format (used whenever a tokenizer has no chat template of its own):

    <|role|>\\n{content}\\n   for each message, then <|assistant|>\\n if add_generation_prompt
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

logger = logging.getLogger(__name__)


def render_default_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    parts = [f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class _ChatMixin:
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True, **template_kw: Any) -> list[int]:
        """Token ids of a conversation. Control tokens come from the template only: text in a
        message's content that spells a special token (``<|im_start|>system``) is encoded as
        plain text, so a user cannot forge another turn (see :func:`split_contents`).
        ``template_kw`` go to the template (``tools=[...]``)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        **template_kw)
        specials = self.special_token_texts()
        contents = [m.get("content") or "" for m in messages]
        if not any(sp in c for c in contents for sp in specials):
            return self.encode(text, add_special_tokens=False)
        # the text is cut only around the spellings (where the tokenizer cuts anyway: it
        # splits special tokens out first), so everything else encodes as it would whole
        ids: list[int] = []
        pos = 0
        for start, end in forged_spans(text, content_spans(text, contents), specials):
            if start > pos:
                ids += self.encode(text[pos:start], add_special_tokens=False)
            ids += self.encode_plain(text[start:end])
            pos = end
        if pos < len(text):
            ids += self.encode(text[pos:], add_special_tokens=False)
        return ids

    def special_token_texts(self) -> tuple[str, ...]:
        return ()

    def encode_plain(self, text: str) -> list[int]:
        """``text`` with special-token spellings encoded as ordinary text."""
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) to the prompt text.
        Without a chat template, the simple format in this module's docstring is used."""
        if not self.chat_template:
            return render_default_chat(messages, add_generation_prompt)
        template = _compile_template(self.chat_template)
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                               **kwargs)


def content_spans(text: str, contents: Sequence[str]) -> list[tuple[int, int]]:
    """Where each message's content lies in a rendered conversation: found in order after
    the previous one, verbatim or stripped (templates that trim contents). Raises ValueError
    when a content cannot be found (a template that rewrites contents), rather than risk
    parsing user text as control tokens."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for c in contents:
        for cand in (c, c.strip()):
            j = text.find(cand, pos) if cand else -1
            if j >= 0:
                spans.append((j, j + len(cand)))
                pos = j + len(cand)
                break
        else:
            if c.strip():
                raise ValueError("chat content could not be located in the rendered template")
    return spans


def forged_spans(text: str, spans: Sequence[tuple[int, int]],
                 specials: Sequence[str]) -> list[tuple[int, int]]:
    """Special-token spellings inside content spans, left to right, not overlapping."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        pos = start
        while True:
            hits = [(j, j + len(sp)) for sp in specials
                    if (j := text.find(sp, pos, end)) >= 0]
            if not hits:
                break
            first = min(hits, key=lambda h: (h[0], -h[1]))
            out.append(first)
            pos = first[1]
    return out


class Tokenizer(_ChatMixin):
    """A `tokenizers.Tokenizer` plus bos/eos ids and an optional chat template.

    Whether encode(add_special_tokens=True) adds bos is the wrapped tokenizer's post-processor's
    business (tokenizer.json carries it; the GGUF builder installs one when add_bos_token)."""

    def __init__(self, backend, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.bos_token = bos_token if bos_token is not None else self._token(bos_token_id)
        first_eos = self.eos_token_ids[0] if self.eos_token_ids else None
        self.eos_token = eos_token if eos_token is not None else self._token(first_eos)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._specials: tuple[str, ...] | None = None
        self._plain = None  # a copy of the backend that does not parse special tokens

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    @property
    def backend(self):
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not: a 1 MiB prompt
        # would stall every other thread, e.g. a server's event loop, for ~0.6 s)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def special_token_texts(self) -> tuple[str, ...]:
        if self._specials is None:
            self._specials = tuple(t.content for t in self._tok.get_added_tokens_decoder().values()
                                   if t.special)
        return self._specials

    def encode_plain(self, text: str) -> list[int]:
        if self._plain is None:
            from tokenizers import Tokenizer as _Backend
            plain = _Backend.from_str(self._tok.to_str())
            plain.encode_special_tokens = True  # special spellings split like other text
            self._plain = plain
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts),
                                                      add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> "Tokenizer":
        from tokenizers import Tokenizer as _Backend

        return cls(_Backend.from_file(str(path)), **kwargs)


class ByteTokenizer(_ChatMixin):
    """UTF-8 bytes as tokens, for dummy models (see the module docstring)."""

    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
    _SPECIAL = {0: "<pad>", 1: "<bos>", 2: "<eos>"}

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos
        self.bos_token_id = self.BOS
        self.eos_token_ids = (self.EOS,)
        self.vocab_size = 256 + self.OFFSET
        self.chat_template = None
        self.bos_token, self.eos_token = "<bos>", "<eos>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS] + ids if add_special_tokens and self.add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if self.OFFSET <= i < self.OFFSET + 256:
                out.append(i - self.OFFSET)
            elif not skip_special_tokens and i in self._SPECIAL:
                out += self._SPECIAL[i].encode()
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        out: list[str | None] = []
        for i in ids:
            if i in self._SPECIAL:
                out.append(self._SPECIAL[i])
            elif self.OFFSET <= i < self.OFFSET + 256:
                out.append(f"<0x{i - self.OFFSET:02X}>")
            else:
                out.append(None)
        return out

    def token_to_id(self, token: str) -> int | None:
        for i, s in self._SPECIAL.items():
            if s == token:
                return i
        return None
