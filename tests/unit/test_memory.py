"""services/memory.py against the real C library (in a child process: mallopt is for the
whole process)."""
from __future__ import annotations

import subprocess
import sys

from services import memory


def test_trim_and_arena_limit_on_glibc():
    code = ("from services.memory import limit_arenas, trim; "
            "print(limit_arenas(2), limit_arenas(0), trim())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:2] == ["True", "False"], out  # 0: glibc's default left alone
    assert out[2] in ("True", "False")  # malloc_trim: 1 when it released memory


def test_gateway_settings_default_to_two_arenas():
    from services.config import gateway_settings
    assert gateway_settings(["--decode-addrs", "127.0.0.1:1"]).malloc_arenas == 2
    assert memory.limit_arenas(0) is False
