"""List the Triton kernels compiled into a cache directory, oldest first, with the time each
was written: run a service with a fresh ``TRITON_CACHE_DIR``, then compare the times with its
log to see which kernels compiled while it served (bench/results/triton_compiles_colocated_s11.log).

    python3 bench/triton_cache_list.py /tmp/tc
"""

from __future__ import annotations

import json
import os
import sys
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


if __name__ == "__main__":
    for t, name in compiled(sys.argv[1]):
        print(time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}", name)
