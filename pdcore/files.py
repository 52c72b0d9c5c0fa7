"""Reading the small files a setting names (a config file, an API key file, a password
file): only a regular file, at most :data:`MAX_BYTES`, as UTF-8, so a FIFO, a device such
as /dev/zero or a huge file is a clear error instead of a hang or a MemoryError."""
from __future__ import annotations

import os
import stat

MAX_BYTES = 1 << 20  # 1 MiB: far above any config or key file


def read_small_file(path: str, what: str, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path``; ValueError naming ``what`` and the path
    when it is not one, cannot be read, or is larger than ``limit``."""
    try:
        st = os.stat(path)  # follows links: what open() would read
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path!r} is not a regular file")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ValueError(f"{what} {path!r} is larger than {limit} bytes")
    return data


def read_small_text(path: str, what: str, limit: int = MAX_BYTES) -> str:
    """:func:`read_small_file` decoded as UTF-8 (ValueError when it is not)."""
    data = read_small_file(path, what, limit)
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path!r} is not UTF-8 text (byte {e.start})") from None
