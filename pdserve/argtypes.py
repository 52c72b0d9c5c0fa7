"""Typed, range-checked argparse values and a parser whose errors are one line (exit 2, no
usage block, no traceback) for the CLI's own flags (the services' flags come from their
settings trees, pdcore/config_tree.py)."""
from __future__ import annotations

import argparse
import math


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _bounds(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"in {_num(lo)}..{_num(hi)}"
    return f">= {_num(lo)}" if lo is not None else f"<= {_num(hi)}"


def integer(lo: int | None = None, hi: int | None = 2**31 - 1):
    """An argparse ``type``: an integer within [lo, hi] (no bound: pass hi=None)."""
    def parse(text: str) -> int:
        try:
            v = int(text) if len(text) <= 100 else int("x")  # no 10**6-digit parse
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {_bounds(lo, hi)}, got {v}")
        return v
    parse.__name__ = "integer"
    return parse


def number(lo: float | None = None, hi: float | None = None, *, gt: float | None = None,
           allow_inf: bool = False):
    """An argparse ``type``: a finite number within [lo, hi] (and > gt); ``allow_inf``
    accepts inf too (e.g. a burst rate)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if math.isnan(v) or (math.isinf(v) and not allow_inf):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {_bounds(lo, hi)}, got {v:g}")
        if gt is not None and v <= gt:
            raise argparse.ArgumentTypeError(f"must be > {gt:g}, got {v:g}")
        return v
    parse.__name__ = "number"
    return parse


def output_file(text: str) -> str:
    """An argparse ``type``: a file the command can write its result to when it is done
    (pdcore.files.output_file_problem), checked before the run."""
    from pdcore.files import output_file_problem
    problem = output_file_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
    return text


def address(text: str) -> str:
    """host:port, an IPv6 host in brackets ([::1]:50051; pdcore/hostport.py)."""
    from pdcore.hostport import split_host_port
    try:
        split_host_port(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def api_key(text: str) -> str:
    """An API key: printable ASCII without whitespace (it travels in gRPC metadata and HTTP
    headers); the error never shows it."""
    from services.auth import api_key_problem
    problem = api_key_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"the key {problem}")
    return text


def int_range(text: str) -> tuple[int, int]:
    """``LO:HI`` (or ``N``) with 1 <= LO <= HI."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI integers, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    if b > 10_000_000:
        raise argparse.ArgumentTypeError(f"expected HI <= 10000000, got {text!r}")
    return a, b
