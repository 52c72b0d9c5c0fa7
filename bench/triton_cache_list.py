"""List the Triton kernels compiled into a cache directory, oldest first, with the time each
was written: run a service with a fresh ``TRITON_CACHE_DIR``, then compare the times with its
log to see which kernels compiled while it served (docs/performance.md, "Triton compiles
during serving").

    python3 -m bench.triton_cache_list /tmp/tc
"""

from __future__ import annotations

import argparse
import json
import os
import time


def compiled(root: str) -> list[tuple[float, str]]:
    rows = []
    for entry in os.listdir(root):
        folder = os.path.join(root, entry)
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name.endswith(".json") and not name.startswith("__grp__"):
                path = os.path.join(folder, name)
                try:
                    meta = json.load(open(path))
                except (OSError, ValueError):
                    continue
                rows.append((os.path.getmtime(path), meta.get("name", name)))
    return sorted(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.triton_cache_list",
                                description=__doc__.splitlines()[0])
    p.add_argument("cache_dir", help="a TRITON_CACHE_DIR")
    for t, name in compiled(p.parse_args(argv).cache_dir):
        print(time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}", name)


if __name__ == "__main__":
    main()
