"""``pdserve config show | docs``: the resolved configuration of an entry point, and the
generated settings reference (docs/configuration.md)."""
from __future__ import annotations

import os
import sys

from pdserve.argtypes import Parser

ROLES = ("gateway", "prefill", "decode", "colocated", "engine", "client")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def show(argv) -> int:
    """``pdserve config show [--role R] [--format toml|json] [that role's flags]``."""
    from services import config
    from services.config_docs import render_show
    from pdcore.config_tree import build
    p = Parser(prog="pdserve config show", add_help=False,
               description="print the configuration an entry point would run with here")
    p.add_argument("--role", choices=ROLES, default="colocated")
    p.add_argument("--format", choices=("toml", "json"), default="toml")
    p.add_argument("-h", "--help", action="store_true")
    a, rest = p.parse_known_args(argv)
    if a.help:
        p.print_help()
        print("\nThe remaining flags are the role's own (pdserve <role> --help).")
        return 0
    try:
        if a.role in ("prefill", "decode", "colocated"):
            s, values = build(config.WorkerSettings, roots=config.ROOTS, argv=rest,
                              defaults={"role": a.role},
                              sections=config.worker_sections(a.role),
                              prog=f"pdserve config show --role {a.role}")
            config.no_secret_flags(values)
            obj = config.resolve_worker(s, values)
        else:
            root = {"gateway": config.GatewaySettings, "engine": config.EngineConfig,
                    "client": config.ClientSettings}[a.role]
            obj, values = build(root, roots=config.ROOTS, argv=rest, sections=(a.role,),
                                prog=f"pdserve config show --role {a.role}")
            config.no_secret_flags(values)  # refused as flags here too (ps shows them)
            if a.role == "engine":  # what LLM(...) would run: the engine resolves the rest
                from engine.engine import resolve_on_this_machine
                obj = resolve_on_this_machine(obj)
    except ValueError as e:  # ConfigError, or a device that is not there
        print(f"pdserve config show: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_show(obj, values, f"pdserve {a.role}: resolved configuration",
                                 a.format))
    if a.format == "json":
        sys.stdout.write("\n")
    return 0


def docs(argv) -> int:
    """``pdserve config docs [--out FILE] [--check]``."""
    from services.config import ROOTS
    from services.config_docs import DOCS_PATH, render_docs
    p = Parser(prog="pdserve config docs", description="the settings reference, generated")
    p.add_argument("--out", default=None, help=f"write it there (e.g. {DOCS_PATH})")
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 when {DOCS_PATH} differs from what would be generated")
    a = p.parse_args(argv)
    text = render_docs(ROOTS)
    if a.check:
        with open(os.path.join(REPO, DOCS_PATH)) as f:
            stale = f.read() != text
        if stale:
            print(f"{DOCS_PATH} is stale: run pdserve config docs --out {DOCS_PATH}",
                  file=sys.stderr)
        return 1 if stale else 0
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        return 0
    sys.stdout.write(text)
    return 0


def main(argv) -> int:
    if not argv or argv[0] not in ("show", "docs"):
        print("usage: pdserve config show [--role R] [flags] | pdserve config docs "
              "[--out FILE | --check]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return (show if argv[0] == "show" else docs)(argv[1:])
