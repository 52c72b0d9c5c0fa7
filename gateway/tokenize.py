"""Prompts to token ids, off the event loop.

Tokenizing a 1 MiB prompt takes about half a second; on the event loop that would stall
every other stream of the gateway. Prompts are tokenized on ``threads`` threads (the
tokenizer releases the GIL while it encodes); at most ``max_pending`` prompts may be in
tokenization or waiting for a thread, beyond which requests are refused at once
(RESOURCE_EXHAUSTED) rather than queue without bound. Chat messages are rendered with the
model's template and encoded so that special-token text in their contents stays text
(Tokenizer.encode_chat).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial


class TokenizerBusy(Exception):
    pass


class PromptTokenizer:
    def __init__(self, tokenizer, *, threads: int = 2, max_pending: int = 256,
                 on_pending=None):
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self.pending = 0
        self._on_pending = on_pending  # called with the new count (a gauge)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def text(self, prompt: str) -> list[int]:
        return await self._run(self.tokenizer.encode, prompt)

    async def chat(self, messages: list[dict], tools: list | None = None) -> list[int]:
        if tools:
            return await self._run(partial(self.tokenizer.encode_chat, tools=tools), messages)
        return await self._run(self.tokenizer.encode_chat, messages)

    async def _run(self, fn, arg) -> list[int]:
        if self.pending >= self.max_pending:
            raise TokenizerBusy(f"{self.pending} prompts are being tokenized; retry later")
        self._count(1)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)
        finally:
            self._count(-1)

    def _count(self, d: int) -> None:
        self.pending += d
        if self._on_pending is not None:
            self._on_pending(self.pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
