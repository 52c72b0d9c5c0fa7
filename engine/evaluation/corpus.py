"""The evaluation corpus: natural text that every machine has offline.

Assembled at run time from the docstrings of a fixed list of Python standard library modules
(each module's own docstring and those of its public classes and functions, in name order;
docstrings under MIN_CHARS are skipped), or read from a user's text file (documents are its
blank-line separated paragraphs). The text is pinned by the sha256 of the documents joined
with ``\\n\\n``: two machines with different Python versions may assemble different text, and
the hash (``--corpus-sha256``) says whether two results measured the same thing.

Each document goes to the ``tune`` or the ``heldout`` part by the first byte of the sha256 of
its title (module.qualname, or the paragraph's index): stable, independent of the others.
Calibration and plan sweeps use ``tune``; reported figures use ``heldout``.
"""
from __future__ import annotations

from dataclasses import dataclass
import hashlib
import importlib
import inspect
import logging

logger = logging.getLogger(__name__)

STDLIB_MODULES = (
    "argparse", "asyncio.events", "asyncio.tasks", "bisect", "calendar", "collections",
    "configparser", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "doctest", "email.message", "enum", "fractions", "ftplib", "functools", "gettext",
    "heapq", "http.client", "http.cookiejar", "imaplib", "inspect", "ipaddress", "logging",
    "mailbox", "optparse", "pathlib", "pdb", "pickle", "pprint", "queue", "random", "re",
    "sched", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid",
    "warnings", "weakref", "xml.dom.minidom", "zipfile",
)
MIN_CHARS = 200


@dataclass(frozen=True)
class Document:
    title: str
    text: str

    @property
    def part(self) -> str:
        return "tune" if hashlib.sha256(self.title.encode()).digest()[0] % 2 == 0 else "heldout"


@dataclass(frozen=True)
class Corpus:
    source: str  # "stdlib-docstrings" or the file's path
    documents: tuple[Document, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.joined(self.documents).encode()).hexdigest()

    @staticmethod
    def joined(docs) -> str:
        return "\n\n".join(d.text for d in docs)

    def part(self, name: str) -> str:
        """The text of the ``tune`` or ``heldout`` documents, joined."""
        if name not in ("tune", "heldout", "all"):
            raise ValueError(f"corpus part must be tune, heldout or all, got {name!r}")
        return self.joined(d for d in self.documents if name == "all" or d.part == name)

    def describe(self) -> dict:
        parts = {p: sum(1 for d in self.documents if d.part == p) for p in ("tune", "heldout")}
        return {"source": self.source, "sha256": self.sha256, "documents": len(self.documents),
                "characters": sum(len(d.text) for d in self.documents), "parts": parts}


def _docstrings(module_name: str):
    mod = importlib.import_module(module_name)
    doc = inspect.getdoc(mod)
    if doc:
        yield module_name, doc
    for name in sorted(vars(mod)):
        if name.startswith("_"):
            continue
        obj = vars(mod)[name]
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != mod.__name__:
            continue  # re-exported from elsewhere: counted there, if at all
        doc = obj.__doc__  # its own docstring (inspect.getdoc would inherit a parent's)
        if doc:
            yield f"{module_name}.{name}", inspect.cleandoc(doc)


def stdlib_corpus(modules: tuple[str, ...] = STDLIB_MODULES) -> Corpus:
    docs: list[Document] = []
    for m in modules:
        try:
            docs.extend(Document(t, d) for t, d in _docstrings(m) if len(d) >= MIN_CHARS)
        except ImportError as e:  # a module this Python lacks changes the hash, visibly
            logger.warning("corpus: skipping %s (%s)", m, e)
    return Corpus("stdlib-docstrings", tuple(docs))


def file_corpus(path: str) -> Corpus:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"corpus file {path!r}: {e}") from None
    paras = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
    if not paras:
        raise ValueError(f"corpus file {path!r} holds no text")
    return Corpus(path, tuple(Document(f"{path}#{i}", p) for i, p in enumerate(paras)))


def load_corpus(path: str | None = None, expect_sha256: str | None = None) -> Corpus:
    """The stdlib corpus, or a file's; ``expect_sha256``: refuse any other text."""
    corpus = file_corpus(path) if path else stdlib_corpus()
    if expect_sha256 and corpus.sha256 != expect_sha256:
        raise ValueError(f"corpus sha256 is {corpus.sha256}, expected {expect_sha256} (a "
                         "different Python version assembles different docstrings; pass a "
                         "corpus file for text that is the same everywhere)")
    return corpus
