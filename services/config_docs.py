"""docs/configuration.md, generated from the settings trees (``pdserve config docs``; a test
fails when the committed page is stale), and the text of ``pdserve config show``."""
from __future__ import annotations

import json
from typing import Any

from pdcore.config_tree import (CONFIG_VAR, FILE_SECTIONS, OTHER_VARIABLES,
                                  KVTRANSFER_VARIABLES, Spec, Values, flat, redact,
                                  show_value, tree)
from pdcore.settings import upper_bound

DOCS_PATH = "docs/configuration.md"

_INTRO = f"""\
# Configuration

<!-- Generated from the settings trees (engine/config.py, services/config.py) by
`pdserve config docs --out docs/configuration.md`; tests/unit/test_config_docs.py fails when
this page is stale. Edit the help lines there, not here. -->

Every entry point has one tree of typed settings (frozen dataclasses that only validate):
the engine (`LLM(...)` and every worker), the worker services, the gateway and the clients.

**Naming.** A setting has one flat name, unique in its tree, and that name is everything
else: the setting `max_num_seqs` is the keyword `LLM(model, max_num_seqs=...)`, the flag
`--max-num-seqs`, the variable `PDSERVE_MAX_NUM_SEQS` and the key `max_num_seqs` of a config
file. Booleans take `--name` / `--no-name` as flags. Older names listed as aliases keep working
in all four places.

**Precedence.** defaults < config file < `PDSERVE_*` variables < flags (< keywords of `LLM`).
The config file is `--config FILE` or `{CONFIG_VAR}=FILE`, TOML (`.toml`) or YAML (`.yaml`,
`.yml`, `.json`).

**Values.** Booleans `1/0, true/false, yes/no, on/off`; lists comma-separated (a list in a
file); `auto` for a setting whose default is auto (resolved when the process starts: a worker
logs its resolved configuration and exports it as the metric `pdserve_config_info`); byte
sizes may carry a suffix (`16GiB`, `512MiB`). Numbers are finite; a setting with no upper
bound of its own takes its kind's (counts 2^31-1, byte sizes 2^50, durations in seconds one
week). A value out of range is an error that names the setting and where it was set; a flag
that exists nowhere is an error naming the nearest flag; a key written twice in a file is an
error. The offline `LLM` ignores variables and file keys of other entry points but refuses
near-misses of its own names (`PDSERVE_MAX_NUM_SEQ`). A file a setting names (the config file,
an API key file, a password file) must be a regular file of at most 1 MiB; YAML aliases are
refused.

**Errors.** A command that cannot start prints one line, `error: ...`, and exits 2 when a
value given to it is wrong (a flag, variable or file value; a file, model or host it names;
values that cannot run together on this device, such as a float `kv_dtype` other than the
model's), 1 when the machine refuses (a port another process holds); never a traceback.

**One environment or file for a whole deployment.** A variable or file key that names a
setting of another entry point is left to it (the gateway ignores `PDSERVE_MAX_NUM_SEQS`); one
that names no setting at all is an error naming the nearest setting. In a file, flat keys
apply to every entry point that has them, and the tables
{", ".join(f"`[{s}]`" for s in FILE_SECTIONS)} apply to that entry point only and win
over the flat keys (`[engine]`: `LLM` and every worker; a worker reads `[engine]`, then
`[worker]`, then its role's table); a tree's groups (`[cache]`, `[scheduler]`, `[kernels]`)
may nest their keys:

```toml
model = "dummy:llama-3-8b"       # gateway and workers
block_size = 16

[gateway]
decode_addrs = ["10.0.0.2:50061"]

[decode]
max_num_seqs = 256
kv_backend = "cuda_ipc,nccl"
```

`pdserve config show --role decode [flags]` prints the configuration a `pdserve decode` with
those flags would run (in this environment, with secrets redacted), in this file format.
"""

_TREES = (
    ("engine", "Engine", "`LLM(model, **settings)`, `pdserve run` and every worker "
                         "(`pdserve prefill | decode | colocated`)"),
    ("worker", "Worker services", "`pdserve prefill | decode | colocated` (with the engine's "
                                  "settings above)"),
    ("gateway", "Gateway", "`pdserve gateway`"),
    ("client", "Clients", "`pdserve generate | chat | bench`"),
)
_GROUP_TITLES = {"cache": "KV cache", "scheduler": "Scheduler", "kernels": "Kernels"}


def _bound_text(v: float) -> str:
    if isinstance(v, int) and v >= 2**20:
        for k in range(20, 64):
            if v in (2**k, 2**k - 1):
                return f"2^{k}" + ("" if v == 2**k else "-1")
    return f"{v:g}"


def type_text(spec: Spec) -> str:
    words = {"int": "integer", "float": "number", "bool": "boolean", "str": "string",
             "tuple": "list"}[spec.kind]
    m = spec.meta
    if m.get("choices"):
        words = " \\| ".join(f"`{c}`" for c in m["choices"])
    parts = []
    if m.get("ge") is not None:
        parts.append(f">= {m['ge']:g}")
    if m.get("gt") is not None:
        parts.append(f"> {m['gt']:g}")
    le = upper_bound(spec.name, spec.kind, m)
    if le is not None:
        parts.append(f"<= {_bound_text(le)}")
    if m.get("unit") == "bytes":
        parts.append("bytes")
    if m.get("pattern"):
        parts.append(m["pattern"][1])
    text = words + (f" ({', '.join(parts)})" if parts else "")
    return text + (" or `auto`" if spec.optional else "")


def _default_text(spec: Spec) -> str:
    v = spec.default
    if spec.meta.get("section"):
        return ""
    text = show_value(spec, v)
    return f"`{text}`" if text else "(empty)"


def _row(spec: Spec) -> str:
    help_ = spec.help.replace("|", "\\|")
    if spec.meta.get("aliases"):
        help_ += " (alias: " + ", ".join(f"`{a}`" for a in spec.meta["aliases"]) + ")"
    if spec.meta.get("secret"):
        help_ += "; secret: never shown"
    return f"| `{spec.name}` | {type_text(spec)} | {_default_text(spec)} | {help_} |"


def _table(specs: list[Spec]) -> list[str]:
    out = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    return out + [_row(s) for s in specs]


def render_docs(roots: dict[str, type]) -> str:
    """The whole of docs/configuration.md."""
    lines = [_INTRO]
    for key, title, who in _TREES:
        # a worker's engine section is the engine tree, listed once above
        specs = [s for s in tree(roots[key]).values()
                 if not (key == "worker" and s.path[0] == "engine")]
        lines += [f"## {title}", "", f"Used by {who}.", ""]
        by_group: dict[str, list[Spec]] = {}
        for s in specs:
            by_group.setdefault(s.group if key == "engine" else "", []).append(s)
        for group, members in by_group.items():
            if group:
                lines += ["", f"### {_GROUP_TITLES.get(group, group)} (`[{group}]`)", ""]
            lines += _table(members)
        lines.append("")
    lines += ["## Other variables", "",
              "Not settings of any tree; each is read where noted.", "",
              "| variable | meaning |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in OTHER_VARIABLES.items()]
    lines += ["", "KV transfer tuning and fault injection: a worker reads these at its start "
              "into the backends' typed options (kvtransfer.registry.options_from_env; each "
              "backend module declares its options dataclass with ranges and help):", "",
              "| variable | meaning |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in KVTRANSFER_VARIABLES.items()]
    lines += ["", "Standard variables of the libraries are theirs: `OTEL_*` (OpenTelemetry: "
              "tracing is on when they name an OTLP exporter or endpoint), `TRITON_INTERPRET` "
              "(Triton: interpret kernels on the CPU), `CXX` (the compiler of the CPU "
              "extension), `CUDA_VISIBLE_DEVICES`, `NCCL_*`.", ""]
    return "\n".join(lines)


def render_show(obj: Any, sources: Values, title: str, fmt: str = "toml") -> str:
    """``obj``'s settings, secrets redacted, one per line with where each came from; in
    TOML (readable back with --config) or JSON."""
    specs = tree(type(obj))
    values = {n: redact(specs[n], v) for n, v in flat(obj).items()}
    if fmt == "json":
        return json.dumps({n: (None if v is None else v) for n, v in values.items()}, indent=1)
    out = [f"# {title}", "# defaults < config file < PDSERVE_* < flags; auto: resolved at start"]
    group = None
    for name, v in values.items():
        g = specs[name].group
        if g != group and g:
            out.append(f"# [{g}]")
        group = g
        src = sources.get(name, (None, "default"))[1]
        note = f"  # {src}" if src != "default" else ""
        if specs[name].meta.get("secret"):  # commented out: read back, it would be a value
            out.append(f"# {name} = {'<redacted>' if v else '(empty)'}  (secret){note}")
            continue
        out.append(f"{name} = {_toml_value(v)}{note}")
    return "\n".join(out) + "\n"


def _toml_value(v: Any) -> str:
    if v is None:
        return '"auto"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(json.dumps(x) for x in v) + "]"
    return json.dumps(v)
