"""A pipeline's GenerateResponse stream -> OpenAI answers: one ``chat.completion`` /
``text_completion`` object (:class:`Answer`), or server-sent events (:class:`Events`):
``data: {chunk}`` frames, the usage chunk when ``stream_options.include_usage`` asked for it
(``choices: []``), then ``data: [DONE]``.

Each response carries the new tokens of one sample (``index``), their text and, when asked,
their logprobs and top logprobs; the one that ends a sample carries its ``finish_reason``,
and the request's last one the usage of all samples (prompt, completion and cached tokens:
``prompt_tokens_details.cached_tokens``).
"""
from __future__ import annotations

import json

from gateway.openai import tools
from gateway.openai.translate import Job
from protos.pdserve.v1 import common_pb2

_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def usage(u: common_pb2.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class TokenText:
    """A token id's own text (for logprobs), cached. Special tokens (the EOS that ended a
    sample) are "": the tokens of a choice join to its text, which leaves them out."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self.tokenizer.decode([tid], skip_special_tokens=True)
        return s


def _top(resp, i: int) -> list[tuple[int, float]]:
    if i >= len(resp.top_logprobs):
        return []
    t = resp.top_logprobs[i]
    return list(zip(t.token_ids, t.logprobs))


def chat_logprobs(resp, text: TokenText) -> list[dict]:
    """``logprobs.content`` entries of one response's tokens."""
    out = []
    for i, (tid, lp) in enumerate(zip(resp.token_ids, resp.logprobs)):
        s = text(tid)
        tops = [{"token": text(t), "logprob": x, "bytes": list(text(t).encode())}
                for t, x in _top(resp, i)]
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": tops})
    return out


def completion_logprobs(resp, text: TokenText, offset: int, top: int) -> dict:
    """Legacy completions logprobs of one response's tokens; ``offset``: text before them."""
    toks, lps, tops, offs = [], [], [], []
    for i, (tid, lp) in enumerate(zip(resp.token_ids, resp.logprobs)):
        s = text(tid)
        toks.append(s)
        lps.append(lp)
        offs.append(offset)
        offset += len(s)
        if top:
            tops.append({text(t): x for t, x in _top(resp, i)})
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops if top else None,
            "text_offset": offs}


def _merge(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    for k in ("tokens", "token_logprobs", "text_offset"):
        acc[k] += new[k]
    if acc["top_logprobs"] is not None:
        acc["top_logprobs"] += new["top_logprobs"]
    return acc


class _Sample:
    __slots__ = ("text", "ids", "chars", "logprobs", "finish", "full", "sent")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.full = ""  # with tools, streamed: the answer so far, and how much went out
        self.sent = 0
        self.chars = 0  # text length so far (completions' text_offset)
        self.logprobs = None  # chat: list of entries; completions: the legacy dict
        self.finish = None


class _Base:
    def __init__(self, job: Job, rid: str, created: int, text: TokenText) -> None:
        self.job, self.created, self.text = job, created, text
        self.id = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + rid
        self.samples = [_Sample() for _ in range(job.n)]
        self.usage: dict | None = None

    def _take(self, resp) -> tuple[int, _Sample, object]:
        """Account one response to its sample; returns (index, sample, its logprobs)."""
        i = resp.index if resp.index < len(self.samples) else 0
        s = self.samples[i]
        lp = None
        if self.job.logprobs and resp.logprobs:
            lp = chat_logprobs(resp, self.text) if self.job.kind == "chat" else \
                completion_logprobs(resp, self.text, s.chars, self.job.top_logprobs)
        s.chars += len(resp.text)
        if resp.finish_reason:
            s.finish = resp.finish_reason
            self.usage = usage(resp.usage)
        return i, s, lp

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.job.model}


class Answer(_Base):
    """The whole answer of a request that did not ask to stream."""

    def add(self, resp) -> None:
        _, s, lp = self._take(resp)
        s.text.append(resp.text)
        s.ids.extend(resp.token_ids)
        if lp is not None:
            s.logprobs = (s.logprobs or []) + lp if self.job.kind == "chat" \
                else _merge(s.logprobs, lp)

    def body(self) -> dict:
        out = self._head(_OBJECT[self.job.kind])
        choices = []
        for i, s in enumerate(self.samples):
            text = "".join(s.text)
            c = {"index": i}
            if self.job.kind == "chat":
                c["message"] = {"role": "assistant", "content": text}
                if self.job.tools is not None:
                    content, calls = tools.parse(text, self.job.tools)
                    if calls:
                        c["message"] = {"role": "assistant", "content": content,
                                        "tool_calls": calls}
                        s.finish = "tool_calls" if s.finish == "stop" else s.finish
                c["logprobs"] = {"content": s.logprobs or []} if self.job.logprobs else None
            else:
                c["text"] = text
                c["logprobs"] = s.logprobs if self.job.logprobs else None
            c["finish_reason"] = s.finish
            if self.job.token_ids:
                c["token_ids"] = s.ids
            choices.append(c)
        out["choices"] = choices
        out["usage"] = self.usage
        return out


class Events(_Base):
    """Server-sent events of a streamed answer, one frame per response."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self._obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
        self._started: set[int] = set()
        # every chunk is this head, one choice, this tail: only the choice is encoded
        head = dumps(self._head(self._obj))
        self._pre = f"data: {head[:-1]},\"choices\":[".encode()
        self._post = (b'],"usage":null}' if self.job.include_usage else b"]}") + b"\n\n"

    def frame(self, resp) -> bytes:
        i, s, lp = self._take(resp)
        c: dict = {"index": i}
        finish = resp.finish_reason or None
        if self.job.kind == "chat":
            text, calls = (resp.text, None) if self.job.tools is None else self._tool(s, resp)
            delta = {"content": text} if text or not finish else {}
            if i not in self._started:
                self._started.add(i)
                delta = {"role": "assistant", "content": text}
            if calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                finish = "tool_calls" if finish == "stop" else finish
            c["delta"] = delta
            c["logprobs"] = {"content": lp} if lp is not None else None
        else:
            c["text"] = resp.text
            c["logprobs"] = lp
        c["finish_reason"] = finish
        if self.job.token_ids:
            c["token_ids"] = list(resp.token_ids)
        return self._pre + dumps(c).encode() + self._post

    def _tool(self, s: _Sample, resp) -> tuple[str, list | None]:
        """With tools: the content that may go out now, and at the end the parsed calls."""
        s.full += resp.text
        if not resp.finish_reason:
            k = tools.releasable(s.full, self.job.tools)
            text, s.sent = s.full[s.sent:k], max(s.sent, k)
            return text, None
        _, calls = tools.parse(s.full, self.job.tools)
        if not calls:
            return s.full[s.sent:], None
        return s.full[s.sent:max(tools.content_end(s.full, self.job.tools), s.sent)], calls

    def tail(self) -> bytes:
        out = b""
        if self.job.include_usage and self.usage is not None:
            chunk = self._head(self._obj)
            chunk["choices"], chunk["usage"] = [], self.usage
            out = b"data: " + dumps(chunk).encode() + b"\n\n"
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(err) -> bytes:
        """An error after the stream began (the status line is sent): an error event."""
        return b"data: " + dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
