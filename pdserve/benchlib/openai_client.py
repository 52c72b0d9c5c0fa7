"""The benchmark's client of the OpenAI-compatible HTTP API (``pdserve bench --api openai``).

A lean HTTP/1.1 client on asyncio streams (keep-alive connections, reused; chunked or sized
bodies; server-sent events), so the client's own cost stays near the gRPC client's and a
comparison measures the server. Each workload item becomes one streamed request
(``stream_options.include_usage``, ``return_token_ids``, ``ignore_eos``): chat items go to
``/v1/chat/completions``, text and token prompts to ``/v1/completions``. TTFT is the first
event that carries tokens; each such event is one streamed message (as a gRPC response is).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
import json
import time


class HttpStatusError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status, self.body = status, body


@dataclass
class Streamed:
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    ttft_s: float = 0.0
    latency_s: float = 0.0
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def head(self) -> tuple[int, dict[str, str]]:
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def body(self, headers: dict[str, str]):
        """The body's pieces as they arrive (chunked or Content-Length)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                yield await self.reader.readexactly(size)
                await self.reader.readexactly(2)
            await self.reader.readline()
        else:
            yield await self.reader.readexactly(int(headers.get("content-length", "0")))


class OpenAIClient:
    def __init__(self, address: str, api_key: str = "") -> None:
        from pdcore.hostport import split_host_port
        self.host, self.port = split_host_port(address)  # [::1]:8000 -> ::1, 8000
        self._host_header = f"[{self.host}]" if ":" in self.host else self.host
        self.api_key = api_key
        self._idle: list[_Conn] = []

    async def close(self) -> None:
        for c in self._idle:
            c.writer.close()
        self._idle.clear()

    async def _conn(self) -> _Conn:
        if self._idle:
            return self._idle.pop()
        return _Conn(*await asyncio.open_connection(self.host, self.port))

    def _request(self, path: str, body: dict) -> bytes:
        data = json.dumps(body).encode()
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        return (f"POST {path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                f"{auth}\r\n").encode() + data

    async def stream(self, item, temperature: float, model: str = "") -> Streamed:
        """Send ``item`` (a workload Item) streamed; what came back, timed from the send."""
        body = {"max_tokens": item.max_tokens, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True,
                "return_token_ids": True}
        if model:
            body["model"] = model
        if item.messages:
            path, body["messages"] = "/v1/chat/completions", item.messages
        else:
            path, body["prompt"] = "/v1/completions", item.token_ids or item.prompt
        out = Streamed()
        t0 = time.perf_counter()
        conn = await self._conn()
        ok = False
        try:
            conn.writer.write(self._request(path, body))
            status, headers = await conn.head()
            if status != 200:
                text = b"".join([p async for p in conn.body(headers)]).decode()
                ok = headers.get("connection", "") != "close"
                raise HttpStatusError(status, text)
            buf = b""
            async for piece in conn.body(headers):
                buf += piece
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    _event(out, ev, time.perf_counter() - t0)
            ok = True
        finally:
            if ok:
                self._idle.append(conn)
            else:
                conn.writer.close()
        out.latency_s = time.perf_counter() - t0
        return out


def _event(out: Streamed, ev: bytes, now: float) -> None:
    if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
        return
    chunk = json.loads(ev[6:])
    if "error" in chunk:
        raise HttpStatusError(200, json.dumps(chunk["error"]))
    if chunk.get("usage"):
        u = chunk["usage"]
        out.prompt_tokens, out.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
        out.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for c in chunk["choices"]:
        ids = c.get("token_ids") or []
        if ids:
            if not out.token_times:
                out.ttft_s = now
            out.token_times.append(now)
            out.token_ids.extend(ids)
        if c.get("finish_reason"):
            out.finish_reason = c["finish_reason"]
