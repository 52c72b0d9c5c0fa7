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


def output_file_problem(path: str) -> str | None:
    """Why a command could not write its result to ``path`` when it is done (None: it
    can): a folder, something that is not a regular file (a FIFO would block the write),
    or a parent that is not a writable folder. Checked before a long run, so the run's work
    is not lost at its end; missing parent folders are fine (the writer creates them)."""
    if not path:
        return "the path is empty"
    if os.path.isdir(path):
        return "it is a folder (name a file in it)"
    if os.path.lexists(path):
        try:
            st = os.stat(path)
        except OSError as e:
            return e.strerror or str(e)
        if not stat.S_ISREG(st.st_mode):
            return "it is not a regular file"
        if not os.access(path, os.W_OK):
            return "it is not writable"
        return None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # the first folder that exists: the writer makes the rest
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent!r} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the folder {parent!r} is not writable"
    return None
