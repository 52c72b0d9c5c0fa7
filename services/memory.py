"""Giving freed heap memory back to the operating system.

A request with a megabyte-sized prompt makes the allocator grow its heap (and the
tokenizer's threads their own arenas); glibc keeps that memory after it is freed, so a
service's resident size would stay at its high-water mark. :func:`trim_periodically` calls
glibc's ``malloc_trim`` every ``interval_s`` seconds (a no-op elsewhere).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)


def _libc_trim():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _libc_trim()


def trim() -> bool:
    """Return free heap memory to the OS now; False where the C library cannot."""
    return bool(_TRIM is not None and _TRIM(0))


async def trim_periodically(interval_s: float = 10.0) -> None:
    if _TRIM is None:
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim)
