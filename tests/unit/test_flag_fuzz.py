"""Every flag of every entry point, given hostile values, ends one of two ways: accepted, or
one error line and exit status 2; never a traceback or another status (issue 22, point 6).
``pdserve config show --role R`` builds and resolves exactly what the service would start
with, without starting it, so every flag of every role can be tried in one process."""
from __future__ import annotations

import contextlib
import io

import pytest

from pdcore.config_tree import tree
from pdserve.config_cli import show
from services.config import ROOTS

HOSTILE = ["inf", "-inf", "nan", "1e400", "9" * 40, "", "-1", "auto", "0", "x\ny", "::1:5",
           "\x00", "1,2", ",", "a" * 5000, "[::1]:5", "16GiB", "-0"]
ROLES = [("gateway", "gateway"), ("decode", "worker"), ("prefill", "worker"),
         ("colocated", "worker"), ("engine", "engine"), ("client", "client")]


def _show(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = show(argv)
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()


@pytest.mark.parametrize("role, root", ROLES)
def test_hostile_values_are_accepted_or_refused_in_one_line(role, root, monkeypatch):
    monkeypatch.delenv("PDSERVE_CONFIG", raising=False)
    problems = []
    for spec in tree(ROOTS[root]).values():
        if spec.kind == "bool":
            continue
        for value in HOSTILE:
            argv = ["--role", role, spec.flag, value]
            if role == "gateway" and spec.name != "decode_addrs":
                argv += ["--decode-addrs", "h:1"]
            rc, err = _show(argv)
            lines = err.strip().splitlines()
            if rc not in (0, 2) or "Traceback" in err or (rc == 2 and len(lines) != 1):
                problems.append((spec.flag, value[:20], rc, err[:200]))
    assert problems == []


@pytest.mark.parametrize("flag, value, message", [
    ("--namespace", "x\ny", "namespace must be 1-64 letters, digits or _ . : -"),
    ("--namespace", "", "namespace must be 1-64 letters"),
    ("--worker-id", "a b", "worker_id must be at most 128 printable ASCII characters"),
    ("--worker-id", "w" * 200, "worker_id must be at most 128"),
    ("--advertise-host", "h\x00st", "advertise_host must be a host name or IP address"),
    ("--hash-seed", "s\r\n", "hash_seed must be at most 256 characters, no control"),
])
def test_names_other_processes_read_are_checked(flag, value, message):
    rc, err = _show(["--role", "decode", flag, value])
    assert rc == 2 and message in err, err
