"""How a settings tree is filled: defaults < config file < ``PDSERVE_*`` variables < flags
(< keyword arguments, for the offline ``LLM``). The only module that reads the process
environment; nothing is read at import time.

A tree is a frozen dataclass whose fields are declared with ``engine.config.setting`` (leaves)
and ``engine.config.section`` (groups). Names are flat: the leaf ``max_num_seqs`` is the flag
``--max-num-seqs``, the variable ``PDSERVE_MAX_NUM_SEQS``, the key ``max_num_seqs`` of a
config file and the keyword ``max_num_seqs=``, wherever it sits in the tree. A setting's
``aliases`` (older names) work in all four places.

Sources:

* config file: ``--config FILE`` or ``PDSERVE_CONFIG=FILE``; TOML (``.toml``) or YAML
  (``.yaml``, ``.yml``, ``.json``). Flat keys apply to every entry point that has them; the
  tables ``[engine]``, ``[worker]``, ``[prefill]``, ``[decode]``, ``[colocated]``,
  ``[gateway]`` and ``[client]`` apply to that entry point only and win over the flat keys;
  the groups of a tree (``[cache]``, ``[scheduler]``, ...) may nest their keys. One file can
  so describe a whole cluster.
* variables: ``PDSERVE_<NAME>``. A variable or file key that names a setting of another entry
  point is left to it (one environment serves a whole deployment); one that names no setting
  at all is an error that names the nearest setting.
* flags: ``--name VALUE`` (booleans: ``--name`` / ``--no-name``).

Text values: booleans ``1/0, true/false, yes/no, on/off``; lists comma-separated; ``auto``
(or ``none``) for a setting whose default is auto; byte sizes may carry a suffix
(``16GiB``, ``512MiB``, ``1e9``).
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
import difflib
import functools
import os
import re
import tomllib
from typing import Any

import yaml

from pdcore.settings import SettingError, field_types, kind_of

PREFIX = "PDSERVE_"
CONFIG_VAR = "PDSERVE_CONFIG"
# Entry-point tables of a config file and the tree each one fills (see the module docstring).
FILE_SECTIONS = {"engine": "engine", "worker": "worker", "prefill": "worker",
                 "decode": "worker", "colocated": "worker", "gateway": "gateway",
                 "client": "client"}
# PDSERVE_* variables that are not settings of any tree and still legitimate.
OTHER_VARIABLES = {
    CONFIG_VAR: "the config file (as --config)",
    "PDSERVE_TORCH": "scripts/install.sh: the torch requirement to install ('' keeps yours)",
    "PDSERVE_MODEL_DIR": "docker-compose.yml: the host folder mounted at /models",
    "PDSERVE_GPU_MODEL": "docker-compose.yml: the model of the gpu profile",
}
# The kvtransfer options a worker takes from the environment at its start
# (kvtransfer.registry.options_from_env, given this module's environ(): each backend declares
# its options as a frozen dataclass in its own module; the variables below map onto them,
# kvtransfer.registry.ENV_OPTIONS is their table and a test keeps the two equal). They are
# not flags: they tune one backend's internals or inject faults.
KVTRANSFER_VARIABLES = {
    "PDSERVE_KV_TIMELINE": "log where each KV transfer's time went",
    "PDSERVE_KV_CHECKSUMS": "per-block checksums on every KV transfer (default on; both "
                            "sides must agree)",
    "PDSERVE_KV_CORRUPT_EVERY": "fault injection: corrupt every Nth KV transfer (the "
                                "receiver's checksum check must catch it); 0: off",
    "PDSERVE_NCCL_LAYERS_PER_MESSAGE": "nccl: layers per message while a chunk computes",
    "PDSERVE_NCCL_PACK_MESSAGE_BYTES": "nccl: size of the gathered messages of a cached part",
    "PDSERVE_NCCL_LIB": "nccl: path of libnccl",
    "PDSERVE_BATCH_COPY": "cuda_ipc: one batched driver call for scattered blocks",
    "PDSERVE_DRIVER_COPY": "cuda_ipc: use the driver's copies",
    "PDSERVE_KERNEL_COPY_BELOW_BYTES": "cuda_ipc: copy kernel below this run size",
    "PDSERVE_CUDA_IPC_LANES": "cuda_ipc: copy streams per transfer",
    "PDSERVE_NIXL_MAX_DESCRIPTOR_BYTES": "nixl: largest descriptor",
}
# Standard variables of the libraries we use, readable through standard_environ().
STANDARD_PREFIXES = ("OTEL_",)


class ConfigError(ValueError):
    """A setting has an invalid value or an unknown name; the message says which and where."""


@dataclass(frozen=True)
class Spec:
    """One leaf of a tree."""

    name: str
    path: tuple[str, ...]  # attribute path from the root, e.g. ("engine", "cache", "block_size")
    group: str  # the section it sits in ("" at the root)
    kind: str  # int, float, bool, str, tuple
    optional: bool  # None allowed (shown as auto)
    default: Any
    meta: Mapping[str, Any]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def var(self) -> str:
        return PREFIX + self.name.upper()

    @property
    def help(self) -> str:
        return self.meta["help"]


@functools.cache
def tree(cls: type) -> dict[str, Spec]:
    """Every leaf of ``cls`` by flat name, in declaration order (sections in place)."""
    out: dict[str, Spec] = {}

    def walk(c: type, path: tuple[str, ...], group: str) -> None:
        hints = field_types(c)
        for f in fields(c):
            if f.metadata.get("section"):
                walk(hints[f.name], path + (f.name,), f.name)
            elif "help" in f.metadata:
                if f.name in out:
                    raise TypeError(f"{cls.__name__}: setting {f.name!r} declared twice")
                kind, optional = kind_of(hints[f.name])
                out[f.name] = Spec(f.name, path + (f.name,), group, kind, optional,
                                   f.default, f.metadata)
    walk(cls, (), "")
    return out


def groups(cls: type) -> set[str]:
    return {s.group for s in tree(cls).values() if s.group}


def aliases(cls: type) -> dict[str, str]:
    """name or alias -> canonical name."""
    out = {}
    for spec in tree(cls).values():
        out[spec.name] = spec.name
        for a in spec.meta.get("aliases", ()):
            out[a] = spec.name
    return out


def typo(word: str, candidates) -> bool:
    """``word`` is unknown but nearly one of ``candidates`` (a misspelling, not a name of
    some other entry point): what a non-strict builder still refuses."""
    return bool(difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.85))


def nearest(word: str, candidates) -> str:
    """`` (did you mean X?)`` for the closest candidate, or ''."""
    best = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {best[0]}?)" if best else ""


# ------------------------------------------------------------------------- text values
_SIZE = re.compile(r"^\s*([0-9.e+]+)\s*([kmgt]i?b?|b)?\s*$", re.I)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_text(spec: Spec, raw: str) -> Any:
    """A setting's value from text (a flag, a variable, a string in a file)."""
    text = raw.strip()
    if spec.optional and text.lower() in ("auto", "none", ""):
        return None
    if spec.kind == "bool":
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")
    if spec.kind == "int":
        if spec.meta.get("unit") == "bytes":
            m = _SIZE.match(text)
            unit = (m.group(2) or "").lower().rstrip("b") if m else ""
            if m and unit in _SIZE_UNITS:
                try:
                    return int(float(m.group(1)) * _SIZE_UNITS[unit])
                except (ValueError, OverflowError):  # 1e400 is inf
                    pass
            raise ValueError(f"expected a byte count (e.g. 17179869184 or 16GiB), got {raw!r}")
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if spec.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
    if spec.kind == "tuple":
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return raw


def _file_value(spec: Spec, value: Any) -> Any:
    """A value read from a file: text is parsed as a flag's would be (``auto`` included), a
    list of strings becomes a tuple, the rest is checked by the dataclass."""
    if isinstance(value, str):
        return parse_text(spec, value)
    if isinstance(value, float) and spec.meta.get("unit") == "bytes":
        return parse_text(spec, repr(value))  # 1e9 or 1.5e9 bytes, as the text would be
    if isinstance(value, list):
        if spec.kind != "tuple" or not all(isinstance(v, str) for v in value):
            raise ValueError(f"expected {_KIND_TEXT[spec.kind]}, got a list of {len(value)}")
        return tuple(value)
    if isinstance(value, dict):
        raise ValueError(f"expected {_KIND_TEXT[spec.kind]}, got a table")
    return value


_KIND_TEXT = {"int": "an integer", "float": "a number", "bool": "true or false",
              "str": "a string", "tuple": "a list of strings"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (the file would
    otherwise silently mean its last one)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} written twice", key_node.start_mark)
        seen.add(key) if isinstance(key, (str, int, float, bool)) else None
    return loader.construct_mapping(node, deep=deep)


def _no_alias(self, parent, index):
    if self.check_event(yaml.events.AliasEvent):  # anchors expand: a few lines, gigabytes
        raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a "
                                          "config file", self.peek_event().start_mark)
    return yaml.composer.Composer.compose_node(self, parent, index)


_UniqueKeyLoader.compose_node = _no_alias

# Numbers as YAML 1.2 (the core schema) reads them, not YAML 1.1: 0777 is 777, not octal
# 511; 1:30 is text, not the sexagesimal 90; 0x / 0o prefixes stay.
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in rules if tag not in (_INT, _FLOAT)]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+.0123456789"))


def _core_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


_UniqueKeyLoader.add_constructor(_INT, _core_int)
_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _unique_mapping)


# ------------------------------------------------------------------------- sources
Values = dict[str, tuple[Any, str]]  # flat name -> (value, where it came from)


def read_file(path: str) -> dict:
    """A config file's top-level mapping (TOML or YAML by extension)."""
    from pdcore.files import read_small_file
    try:
        data = read_small_file(path, "config file")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        if path.endswith(".toml"):
            loaded = tomllib.loads(data.decode())
        elif path.endswith((".yaml", ".yml", ".json")):
            loaded = yaml.load(data, Loader=_UniqueKeyLoader) or {}
        else:
            raise ConfigError(f"config file {path!r}: the name must end in .toml, .yaml, "
                              ".yml or .json")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        if getattr(e, "problem", None) and mark is not None:  # YAML: what, and where
            text = f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
        else:
            text = " ".join(str(e).split())
        first = text[:200] if text else type(e).__name__
        raise ConfigError(f"config file {path!r} does not parse: {first}") from None
    except RecursionError:
        raise ConfigError(f"config file {path!r} is nested too deeply") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of settings")
    return loaded


def file_values(path: str, cls: type, sections: Sequence[str],
                roots: Mapping[str, type], strict: bool = True) -> Values:
    """The settings of ``cls`` in the file at ``path``: flat keys, then the tables listed in
    ``sections`` (in order, later wins). Keys of other entry points are checked and left
    (not ``strict``: keys no root in ``roots`` knows are left unchecked)."""
    data = read_file(path)
    names = aliases(cls)
    every = {n for r in roots.values() for n in aliases(r)}
    every_group = {g for r in roots.values() for g in groups(r)}
    out: Values = {}

    own_groups = groups(cls)

    def walk(d: Mapping, where: str, own: bool, allowed: set[str], allowed_groups: set[str]):
        for key, value in d.items():
            key = str(key) if str(key).isprintable() else repr(str(key))[:80]
            if isinstance(value, dict) and key in allowed_groups:
                # a group of another tree (the engine's [cache] for the gateway) is not ours;
                # only that group's settings go in it (cache: {port: 5} is a mistake)
                members = {a for r in roots.values() for a, n in aliases(r).items()
                           if tree(r)[n].group == key} & allowed
                walk(value, f"{where}{key}.", own and key in own_groups, members,
                     allowed_groups)
                continue
            if key not in allowed:
                if not strict and not typo(key, allowed):
                    continue  # another entry point's setting, perhaps
                raise ConfigError(f"config file {path!r}: unknown setting {where}{key}"
                                  + nearest(key, allowed))
            if own and key in names:
                name = names[key]
                try:
                    out[name] = (_file_value(tree(cls)[name], value), f"{path}: {where}{key}")
                except ValueError as e:
                    raise ConfigError(f"config file {path!r}: {where}{key}: {e}") from None

    top = {k: v for k, v in data.items() if not (k in FILE_SECTIONS and isinstance(v, dict))}
    walk(top, "", True, every, every_group)
    for section, root in FILE_SECTIONS.items():
        body = data.get(section)
        if root not in roots:
            continue  # a table of an entry point the caller does not know (not strict)
        if isinstance(body, dict) and section not in sections:
            r = roots[root]
            walk(body, f"{section}.", False, set(aliases(r)), groups(r))
    for section in sections:
        body = data.get(section)
        if isinstance(body, dict):
            walk(body, f"{section}.", True, set(names), groups(cls))
    return out


def known_variables(roots: Mapping[str, type]) -> set[str]:
    return ({PREFIX + n.upper() for r in roots.values() for n in aliases(r)}
            | set(OTHER_VARIABLES) | set(KVTRANSFER_VARIABLES))


def env_values(env: Mapping[str, str], cls: type, roots: Mapping[str, type],
               strict: bool = True) -> Values:
    """The settings of ``cls`` set by ``PDSERVE_*`` variables; an unknown one is an error
    (not ``strict``: ignored -- a library call must not fail on a service's variable)."""
    known = known_variables(roots)
    for var in env:
        if var.startswith(PREFIX) and var not in known and (strict or typo(var, known)):
            raise ConfigError(f"unknown variable {var}" + nearest(var, known))
    out: Values = {}
    for alias, name in aliases(cls).items():
        var = PREFIX + alias.upper()
        if var in env:
            try:
                out[name] = (parse_text(tree(cls)[name], env[var]), var)
            except ValueError as e:
                raise ConfigError(f"{var}: {e}") from None
    return out


class _Parser(argparse.ArgumentParser):
    """Errors are one line (no usage block); unknown flags name the nearest known one."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_strict(self, argv: Sequence[str]) -> argparse.Namespace:
        ns, rest = self.parse_known_args(argv)
        if rest:
            flags = [o for a in self._actions for o in a.option_strings]
            bad = next((r for r in rest if r.startswith("-")), rest[0])
            self.error(f"unrecognized arguments: {' '.join(rest)}"
                       + nearest(bad.split("=")[0], flags))
        return ns


def parser(cls: type, prog: str, description: str = "",
           defaults: Mapping[str, Any] | None = None) -> _Parser:
    """Flags of every setting of ``cls`` (values kept as text; typed by :func:`build`)."""
    p = _Parser(prog=prog, allow_abbrev=False, description=description or (
        f"{cls.__name__}: defaults < config file < PDSERVE_* variables < flags "
        "(docs/configuration.md)"))
    p.add_argument("--config", metavar="FILE", default=None,
                   help=f"TOML or YAML config file [{CONFIG_VAR}]")
    defaults = defaults or {}
    for spec in tree(cls).values():
        shown = defaults.get(spec.name, spec.default)
        help_ = f"{spec.help} [{spec.var}; default {show_value(spec, shown)}]"
        opts = [spec.flag] + ["--" + a.replace("_", "-") for a in spec.meta.get("aliases", ())]
        if spec.kind == "bool":
            p.add_argument(*opts, dest=spec.name, action=argparse.BooleanOptionalAction,
                           default=None, help=help_)
        else:
            p.add_argument(*opts, dest=spec.name, default=None, metavar=spec.name.upper(),
                           help=help_)
    return p


def _flag_used(spec: Spec, argv: Sequence[str] | None) -> str:
    """The option string that set ``spec`` (an alias, if that is what argv used)."""
    names = [spec.flag] + ["--" + a.replace("_", "-") for a in spec.meta.get("aliases", ())]
    used = [t.split("=")[0] for t in argv or () if t.split("=")[0] in names
            or t.split("=")[0] in ("--no-" + n[2:] for n in names)]
    return used[-1] if used else spec.flag


def flag_values(ns: argparse.Namespace, cls: type, argv: Sequence[str] | None = None) -> Values:
    out: Values = {}
    for spec in tree(cls).values():
        raw = getattr(ns, spec.name, None)
        if raw is None:
            continue
        flag = _flag_used(spec, argv)
        try:
            out[spec.name] = (raw if isinstance(raw, bool) else parse_text(spec, raw), flag)
        except ValueError as e:
            raise ConfigError(f"{flag}: {e}") from None
    return out


def keyword_values(kw: Mapping[str, Any], cls: type) -> Values:
    names = aliases(cls)
    out: Values = {}
    for key, value in kw.items():
        if key not in names:
            raise TypeError(f"unknown setting {key!r}" + nearest(key, names))
        out[names[key]] = (value, f"keyword {key}")
    return out


# ------------------------------------------------------------------------- building
def construct(cls: type, values: Values) -> Any:
    """An instance of ``cls`` from flat values (sections built from their leaves)."""
    def make(c: type) -> Any:
        hints = field_types(c)
        kw = {}
        for f in fields(c):
            if f.metadata.get("section"):
                kw[f.name] = make(hints[f.name])
            elif f.name in values:
                kw[f.name] = values[f.name][0]
        return c(**kw)
    try:
        return make(cls)
    except SettingError as e:
        where = values.get(e.name, (None, None))[1]
        raise ConfigError(f"{e}" + (f" (set by {where})" if where and where != "default"
                                     else "")) from None
    except ValueError as e:
        raise ConfigError(f"invalid {cls.__name__}: {e}") from None


def environ() -> Mapping[str, str]:
    """The process environment (read here only)."""
    return os.environ


def build(cls: type, *, roots: Mapping[str, type], argv: Sequence[str] | None = None,
          env: Mapping[str, str] | None = None, keywords: Mapping[str, Any] | None = None,
          defaults: Mapping[str, Any] | None = None, sections: Sequence[str] = (),
          prog: str = "pdserve", config_file: str | None = None,
          namespace: argparse.Namespace | None = None, strict: bool = True
          ) -> tuple[Any, Values]:
    """``(instance, sources)``: ``cls`` filled from entry-point ``defaults`` < the config
    file < ``env`` (default: the process environment) < flags in ``argv`` (None: no flags
    parsed; or ``namespace``, already parsed by :func:`parser` plus the caller's own flags)
    < ``keywords``. ``sections``: the file tables that apply (e.g. worker, decode).
    Bad values raise ConfigError, unknown keywords TypeError; bad flags exit 2 (argparse).
    ``strict``: unknown variables and file keys are errors (entry points that know every
    root); a library entry point that knows only its own root passes False, and then only
    near-misses of its own names are errors (``PDSERVE_MAX_NUM_SEQ``)."""
    env = environ() if env is None else env
    values: Values = {k: (v, "default") for k, v in (defaults or {}).items()}
    ns = namespace
    if ns is None and argv is not None:
        ns = parser(cls, prog, defaults=defaults).parse_strict(argv)
    path = (ns.config if ns is not None else None) or config_file or env.get(CONFIG_VAR)
    if path:
        values.update(file_values(path, cls, sections, roots, strict))
    values.update(env_values(env, cls, roots, strict))
    if ns is not None:
        values.update(flag_values(ns, cls, argv))
    values.update(keyword_values(keywords or {}, cls))
    return construct(cls, values), values


# ------------------------------------------------------------------------- reading back
def flat(obj: Any) -> dict[str, Any]:
    """Flat name -> value of every setting of the tree ``obj``."""
    out = {}
    for name, spec in tree(type(obj)).items():
        v = obj
        for attr in spec.path:
            v = getattr(v, attr)
        out[name] = v
    return out


REDACTED = "<redacted>"
# a query parameter that carries a credential (redis-py reads ?password=; others use these)
_SECRET_PARAMS = re.compile(r"([?&;](?:password|passwd|pass|pwd|token|secret|api_key|"
                            r"apikey|key|auth)=)[^&;#]*", re.I)


def redact(spec: Spec, value: Any) -> Any:
    """``value`` as it may be shown: secrets hidden, passwords cut out of URLs."""
    if spec.meta.get("secret") and value:
        return REDACTED
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by ``<redacted>``: the password of its user
    info (everything between the first ':' after '//' and the last '@' before the path, so a
    password holding '@' or ':' is cut whole) and credential query parameters."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0),
              default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:  # the last '@' of the authority ends the user info
        userinfo, host = authority.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        authority = f"{user}:{REDACTED}@{host}" if ":" in userinfo else f"{REDACTED}@{host}"
    elif "@" in tail.split("?", 1)[0]:  # an unencoded '/' inside the password: all of it
        return f"{scheme}://{REDACTED}"
    tail = _SECRET_PARAMS.sub(rf"\g<1>{REDACTED}", tail)
    return f"{scheme}{sep}{authority}{tail}"


def show_value(spec: Spec, value: Any) -> str:
    """A value as text that parse_text reads back (None: auto; lists comma-separated)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def redacted_flat(obj: Any) -> dict[str, str]:
    """Every setting as shown text, secrets redacted (logs, the info metric)."""
    specs = tree(type(obj))
    return {n: show_value(specs[n], redact(specs[n], v)) for n, v in flat(obj).items()}


def standard_environ() -> dict[str, str]:
    """The standard variables of the libraries we configure (OpenTelemetry's OTEL_*)."""
    return {k: v for k, v in os.environ.items() if k.startswith(STANDARD_PREFIXES)}


def set_library_environ(values: Mapping[str, str]) -> None:
    """Write libraries' own variables (NCCL_*, NVSHMEM_*: read by them when they start) into
    this process's environment; never pdserve settings (written here only)."""
    for k, v in values.items():
        if k.startswith("PDSERVE_"):
            raise ValueError(f"{k} is a pdserve setting, not a library variable")
        os.environ[k] = v


def child_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: ours plus ``extra``."""
    return {**os.environ, **(extra or {})}
