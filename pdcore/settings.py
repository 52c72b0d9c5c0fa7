"""Declaring settings: every user-facing field of every configuration tree (the engine's
in engine/config.py, the services' in services/config.py) is a dataclass field made by
:func:`setting` (a help line, a type from its annotation, a range) or :func:`section` (a
nested group), checked by :func:`check_settings` in its ``__post_init__``. Below every
package that has settings; pdcore/config_tree.py builds the trees.
"""
from __future__ import annotations

from dataclasses import field, fields
import functools
import math
import re
import types
import typing
from typing import Any


def setting(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, choices: tuple[str, ...] | None = None,
            secret: bool = False, aliases: tuple[str, ...] = (), unit: str | None = None,
            pattern: tuple[str, str] | None = None) -> Any:
    """A user-facing field: ``help`` is its one-line description (``--help``, the docs);
    ``ge`` / ``gt`` / ``le`` bound a number, ``choices`` a string; ``secret`` values are
    redacted wherever the configuration is shown; ``aliases`` are older names that still
    work (as keyword, flag and variable); ``unit="bytes"`` accepts 16GiB-style strings;
    ``pattern`` is ``(regex, what it allows in words)``, a string's whole value must match."""
    return field(default=default, metadata={
        "help": help, "ge": ge, "gt": gt, "le": le, "choices": choices, "secret": secret,
        "aliases": tuple(aliases), "unit": unit, "pattern": pattern})


# Patterns of string settings that name things other processes read (ids, keys, hosts)
NAME = (r"[A-Za-z0-9_.:-]{1,64}", "1-64 letters, digits or _ . : -")
ID_TEXT = (r"[!-~]{0,128}", "at most 128 printable ASCII characters, no spaces")
HOST = (r"[A-Za-z0-9_.:%\[\]-]{0,253}", "a host name or IP address")
LABEL = (r"[^\x00-\x1f\x7f]{0,256}", "at most 256 characters, no control characters")


def section(cls: type, help: str) -> Any:
    """A nested group of settings (its field names stay flat and unique in the tree)."""
    return field(default_factory=cls, metadata={"section": True, "help": help})


class SettingError(ValueError):
    """An invalid setting value; ``name`` is the field it is about."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def kind_of(hint: Any) -> tuple[str, bool]:
    """``(kind, optional)`` of an annotation: kind is int, float, bool, str or tuple
    (a tuple of strings); optional when None is allowed (None means "auto")."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if typing.get_origin(hint) is tuple:
        return "tuple", optional
    return hint.__name__, optional


def setting_fields(cls: type) -> list[tuple[Any, str, bool]]:
    """``(dataclass field, kind, optional)`` of each setting of ``cls`` (sections excluded)."""
    hints = field_types(cls)
    return [(f, *kind_of(hints[f.name])) for f in fields(cls)
            if "help" in f.metadata and not f.metadata.get("section")]


_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false",
               "str": "a string", "tuple": "a list of strings"}


def check_value(name: str, kind: str, optional: bool, meta, value: Any) -> Any:
    """``value`` checked against a setting's type and range; returns it normalised (an int
    for a float field becomes a float, a list a tuple). Raises SettingError."""
    if value is None:
        if optional:
            return None
        raise SettingError(name, f"{name} must be set, got None")
    ok = {"bool": isinstance(value, bool),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "str": isinstance(value, str),
          "tuple": isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)}
    if not ok[kind]:
        raise SettingError(name, f"{name} must be {_KIND_WORDS[kind]}, got {_short(value)}")
    if kind == "float":
        try:
            value = float(value)
        except OverflowError:
            raise SettingError(name, f"{name} must be a finite number, got {_short(value)}") \
                from None
        if not math.isfinite(value):
            raise SettingError(name, f"{name} must be a finite number, got {value!r}")
    elif kind == "tuple":
        value = tuple(value)
    le = upper_bound(name, kind, meta)
    if meta.get("ge") is not None and value < meta["ge"]:
        raise SettingError(name, f"{name} must be >= {meta['ge']:g}, got {_short(value)}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise SettingError(name, f"{name} must be > {meta['gt']:g}, got {_short(value)}")
    if le is not None and value > le:
        raise SettingError(name, f"{name} must be <= {_bound(le)}, got {_short(value)}")
    if meta.get("pattern") and value is not None and not re.fullmatch(meta["pattern"][0],
                                                                      value):
        raise SettingError(name, f"{name} must be {meta['pattern'][1]}, got {_short(value)}")
    if meta.get("choices") and value not in meta["choices"]:
        raise SettingError(name, f"{name} must be one of {', '.join(meta['choices'])}, "
                                 f"got {_short(value)}")
    return value


# Upper bounds of settings that declare none (no value beyond them is meaningful, and huge
# ones overflow the C types they end in: gRPC options, torch sizes, timers):
MAX_INT = 2**31 - 1  # counts and sizes in units
MAX_BYTES = 2**50  # byte sizes (unit="bytes"): 1 PiB
MAX_SECONDS = 7 * 24 * 3600.0  # durations (names ending in _s): one week


def upper_bound(name: str, kind: str, meta) -> float | None:
    """The largest value of a setting: its declared ``le``, else the bound of its kind."""
    if meta.get("le") is not None:
        return meta["le"]
    if kind == "int":
        return MAX_BYTES if meta.get("unit") == "bytes" else MAX_INT
    if kind == "float" and name.endswith("_s") and not name.endswith("_per_s"):
        return MAX_SECONDS
    return None


def _bound(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def _short(value: Any) -> str:
    if isinstance(value, (list, tuple, dict, set)):  # never the repr of a whole structure
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} characters)"


def check_settings(obj: Any) -> None:
    """Type and range checks of every setting of the frozen dataclass ``obj`` (call it first
    in ``__post_init__``); normalised values are written back."""
    for f, kind, optional in setting_fields(type(obj)):
        value = getattr(obj, f.name)
        checked = check_value(f.name, kind, optional, f.metadata, value)
        if checked is not value:
            object.__setattr__(obj, f.name, checked)  # frozen: normalised once, here
