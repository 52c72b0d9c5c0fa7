"""No stray environment reads: outside pdcore/config_tree.py (the configuration module)
nothing in the product reads os.environ / os.getenv, and nothing reads them at import time.
The source is walked with ``ast``; the exceptions are listed below, each with its reason."""
from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("engine", "services", "gateway", "prefill_worker", "decode_worker", "pdserve",
            "kvtransfer", "protos")
CONFIG_MODULE = "pdcore/config_tree.py"
PENDING_PREFIXES: tuple[str, ...] = ()  # nothing left: kvtransfer reads no environment
# Standard variables that libraries define (not pdserve settings) and that pdserve reads in
# place: (file, variable) -> why. None left: TRITON_INTERPRET and CXX go through
# pdcore.config_tree.environ() too.
STANDARD: dict[tuple[str, str], str] = {}
_OS_ATTRS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def env_reads(source: str) -> list[tuple[int, bool]]:
    """``(line, at_import_time)`` of each use of the environment in ``source``."""
    tree = ast.parse(source)
    os_names = {"os"}
    found: list[tuple[int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, True) for a in node.names if a.name in _OS_ATTRS]
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function |= {id(n) for n in ast.walk(node)} - {id(node)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _OS_ATTRS
                and isinstance(node.value, ast.Name) and node.value.id in os_names):
            found.append((node.lineno, id(node) not in in_function))
    return found


def _product_files():
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    yield os.path.relpath(path, REPO).replace(os.sep, "/"), path


def test_no_environment_read_outside_the_configuration_module():
    stray = []
    for rel, path in _product_files():
        if rel == CONFIG_MODULE or rel.startswith(PENDING_PREFIXES):
            continue
        with open(path) as f:
            source = f.read()
        lines = source.splitlines()
        for line, _ in env_reads(source):
            text = lines[line - 1]
            if any(rel == f and var in text and "PDSERVE_" not in text
                   for f, var in STANDARD):
                continue
            stray.append(f"{rel}:{line}: {text.strip()}")
    assert not stray, "environment read outside pdcore/config_tree.py:\n" + "\n".join(stray)


def test_nothing_reads_the_environment_at_import_time():
    at_import = []
    for rel, path in _product_files():
        if rel.startswith(PENDING_PREFIXES):
            continue
        with open(path) as f:
            source = f.read()
        at_import += [f"{rel}:{line}" for line, top in env_reads(source) if top]
    assert not at_import, at_import


def test_the_checker_finds_reads():
    src = ("import os as o\nfrom os import getenv\nX = o.environ.get('PDSERVE_X')\n"
           "def f():\n    return o.getenv('A')\ng = lambda: o.environ['B']\n")
    assert sorted(env_reads(src)) == [(2, True), (3, True), (5, False), (6, False)]
    assert env_reads("import os\nos.path.join('a')\nenviron = {}\n") == []


def test_standard_exceptions_still_exist():
    """Each listed exception is a real read of that variable (a stale entry would hide one)."""
    for (rel, var), why in STANDARD.items():
        with open(os.path.join(REPO, rel)) as f:
            source = f.read()
        lines = source.splitlines()
        assert any(var in lines[line - 1] for line, _ in env_reads(source)), (rel, var, why)


def test_the_kvtransfer_variables_the_builder_knows_are_the_registrys():
    from kvtransfer.registry import ENV_OPTIONS
    from pdcore.config_tree import KVTRANSFER_VARIABLES
    assert set(KVTRANSFER_VARIABLES) == {v for v in ENV_OPTIONS if v.startswith("PDSERVE_")}
