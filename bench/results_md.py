"""bench/RESULTS.md from the result sets under bench/results/: every benchmark's current
figures, each with its file, command, commit, machine and date.

    python3 -m bench.results_md            (rewrite bench/RESULTS.md)
    python3 -m bench.results_md --check    (exit 1 if it is stale or a result set is broken)

A result set is a folder ``bench/results/<benchmark>/<set>/``. What the generator knows
about a file comes from one of two places:

- a JSON written by a driver: its header (pdserve.benchlib.harness) has the command, the
  commit, the machine, the date and which values are the headline ``figures``;
- the folder's ``set.json`` sidecar, for files written before the harness (and for logs
  and plots): per file the command (recorded in the file, or recovered from the notes of
  the time), ``measured_at`` (the commit measured, where the file or the notes say it,
  else null), ``added_in`` / ``last_changed_in`` (from ``git log --follow``: when the
  file entered the repository, which is not the commit measured) and its figures.
  For a file with a header, a sidecar entry may only choose other figures or add a note.

Every file of a set must be described one way or the other, and every figure must resolve;
``--check`` and tests/unit/test_bench_results.py fail otherwise. Superseded results are
deleted (git keeps them; docs/performance.md lists the ones it cites).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.benchlib.harness import REPO, RESULTS

OUT = REPO / "bench" / "RESULTS.md"
SIDECAR = "set.json"


@dataclass
class Entry:
    """What RESULTS.md says about one result file."""
    path: Path
    command: str = ""
    command_source: str = ""
    commit: str = ""  # how the commit measured is known, rendered
    machine: str = ""
    date: str = ""
    note: str = ""
    figures: list = field(default_factory=list)


@dataclass
class ResultSet:
    benchmark: str
    name: str
    folder: Path
    about: str = ""
    entries: list[Entry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def short(sha: str | None) -> str:
    return sha[:7] if sha else ""


def resolve(doc, path: list):
    """Walk ``path`` (keys, indexes, ``{"key": value}`` selectors) through ``doc``."""
    cur = doc
    for step in path:
        if isinstance(step, dict):  # the list item whose fields match all of step's
            cur = next(x for x in cur if isinstance(x, dict)
                       and all(x.get(k) == v for k, v in step.items()))
        elif isinstance(cur, list):
            cur = cur[step]
        else:
            cur = cur[step]
    return cur


def figure_value(file: Path, fig: dict, cache: dict) -> str:
    """The figure's value as text, or raise (KeyError, StopIteration, ValueError, ...)."""
    if "pattern" in fig:
        m = re.search(fig["pattern"], file.read_text())
        if not m:
            raise ValueError(f"pattern {fig['pattern']!r} not in {file.name}")
        value = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    else:
        if file not in cache:
            cache[file] = json.loads(file.read_text())
        value = resolve(cache[file], fig["path"])
    if value is None:
        return "-"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{fig['name']}: {value!r} is not a number")
    text = format(value, fig["format"]) if fig.get("format") else _plain(value)
    unit = fig.get("unit", "")
    return f"{text} {unit}".strip() if unit not in ("%",) else f"{text}%"


def _plain(v) -> str:
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _from_header(path: Path, doc: dict) -> Entry:
    git = doc.get("git") or {}
    commit = short(doc.get("commit")) or "not recorded"
    if git.get("dirty"):
        commit += f" with uncommitted changes (diff {str(git.get('diff_sha1'))[:8]})"
    m = doc.get("machine") or {}
    gpus = m.get("gpus") or []
    machine = (f"{len(gpus)} x {gpus[0].split(', ')[1]}" if gpus else
               f"{m.get('cpus')} CPUs, {m.get('platform', '')}")
    env = " ".join(f"{k}={v}" for k, v in (doc.get("env") or {}).items()
                   if k.startswith(("PDSERVE_", "NCCL_", "CUDA_VISIBLE_DEVICES")))
    return Entry(path, command=f"{env} {doc['command']}".strip(),
                 commit=f"{commit} (recorded by the run)", machine=machine,
                 date=str(doc.get("date", ""))[:16].replace("T", " "),
                 figures=list(doc.get("figures") or []))


COMMIT_KEYS = ("added_in", "last_changed_in", "measured_at")
FULL_SHA = re.compile(r"[0-9a-f]{40}")


def _from_sidecar(path: Path, rec: dict) -> Entry:
    if rec.get("measured_at"):
        commit = short(rec["measured_at"])
        if rec.get("measured_note"):
            commit += f" ({rec['measured_note']})"
    else:
        commit = ("not recorded" + (f" ({rec['measured_note']})" if rec.get("measured_note")
                                    else ""))
    if rec.get("added_in"):
        commit += f"; file added in {short(rec['added_in'])}"
    if rec.get("last_changed_in") and rec.get("last_changed_in") != rec.get("added_in"):
        commit += f", last changed in {short(rec['last_changed_in'])}"
    env = rec.get("command_env", "")
    command = f"{env} {rec.get('command', '')}".strip()
    return Entry(path, command=command, command_source=rec.get("command_source", ""),
                 commit=commit, machine=rec.get("machine", ""),
                 date=rec.get("date", ""), note=rec.get("note", ""),
                 figures=list(rec.get("figures") or []))


def load_set(folder: Path) -> ResultSet:
    rs = ResultSet(folder.parent.name, folder.name, folder)
    side = {}
    if (folder / SIDECAR).exists():
        side = json.loads((folder / SIDECAR).read_text())
        rs.about = side.get("about", "")
    described = side.get("files", {})
    for name, rec in described.items():
        if not (folder / name).exists():
            rs.problems.append(f"{folder / name}: in {SIDECAR} but missing")
        for key in COMMIT_KEYS:  # a commit is a full hash; words go in measured_note
            if rec.get(key) is not None and not FULL_SHA.fullmatch(str(rec[key])):
                rs.problems.append(f"{folder / name}: {key} {rec[key]!r} is not a 40-hex commit")
    for file in sorted(p for p in folder.iterdir() if p.name != SIDECAR):
        if file.is_dir():
            rs.problems.append(f"{file}: a folder inside a result set")
            continue
        doc = None
        if file.suffix == ".json":
            try:
                doc = json.loads(file.read_text())
            except ValueError as exc:
                rs.problems.append(f"{file}: not JSON ({exc})")
                continue
        rec = described.get(file.name)
        if isinstance(doc, dict) and {"benchmark", "command", "commit", "figures"} <= set(doc):
            entry = _from_header(file, doc)
            if rec:  # the sidecar may pick other figures or add a note
                entry.figures = rec.get("figures", entry.figures)
                entry.note = rec.get("note", entry.note)
            rs.entries.append(entry)
            rs.about = rs.about or doc.get("about", "")
        elif rec is not None:
            rs.entries.append(_from_sidecar(file, rec))
        else:
            rs.problems.append(f"{file}: neither a harness header nor an entry in {SIDECAR}")
    return rs


def load_sets(root: Path = RESULTS) -> list[ResultSet]:
    sets, stray = [], []
    for bench in sorted(p for p in root.iterdir() if p.is_dir()):
        for folder in sorted(p for p in bench.iterdir()):
            if folder.is_dir():
                sets.append(load_set(folder))
            else:
                stray.append(folder)
    for f in sorted(p for p in root.iterdir() if p.is_file()):
        stray.append(f)
    if stray:
        sets.append(ResultSet("", "", root, problems=[
            f"{f}: outside a result set (bench/results/<benchmark>/<set>/)" for f in stray]))
    return sets


def render(sets: list[ResultSet]) -> tuple[str, list[str]]:
    """RESULTS.md's text and the problems found (files, figures)."""
    problems = [p for s in sets for p in s.problems]
    cache: dict = {}
    lines = ["# Benchmark results", "",
             "Generated by `python3 -m bench.results_md` from the result sets under",
             "`bench/results/<benchmark>/<set>/`; do not edit (tests/unit/test_bench_results.py",
             "fails when this file is stale). What each benchmark measures, how to run it and",
             "what limits its figures: [docs/performance.md](../docs/performance.md).", "",
             "*Commit* is the code measured where the run or the notes of the time recorded it;",
             "*file added in* is when the file entered the repository, which can be later.", ""]
    current = None
    for s in (x for x in sets if x.benchmark):
        if s.benchmark != current:
            current = s.benchmark
            lines += [f"## {current}", ""]
        lines += [f"### {current}/{s.name}", ""]
        if s.about:
            lines += [s.about, ""]
        for e in s.entries:
            rel = Path(os.path.relpath(e.path, REPO)).as_posix()
            link = Path(os.path.relpath(e.path, OUT.parent)).as_posix()
            lines.append(f"- [`{e.path.name}`]({link})"
                         + (f": {e.note}" if e.note else ""))
            source = f" ({e.command_source})" if e.command_source else ""
            lines.append(f"  - command: `{e.command}`{source}" if e.command else
                         "  - command: not recorded")
            lines.append(f"  - commit: {e.commit}")
            if e.machine or e.date:
                lines.append(f"  - machine: {e.machine}" + (f"; {e.date}" if e.date else ""))
            for fig in e.figures:
                try:
                    value = figure_value(e.path, fig, cache)
                except (KeyError, IndexError, StopIteration, TypeError, ValueError) as exc:
                    problems.append(f"{rel}: figure {fig.get('name')!r}: {exc!r}")
                    value = "?"
                lines.append(f"  - {fig['name']}: **{value}**")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n", problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.results_md",
                                description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="only compare with bench/RESULTS.md; exit 1 if stale or broken")
    a = p.parse_args(argv)
    text, problems = render(load_sets())
    for msg in problems:
        print(f"problem: {msg}", file=sys.stderr)
    if a.check:
        stale = not OUT.exists() or OUT.read_text() != text
        if stale:
            print(f"{OUT.relative_to(REPO)} is stale: run python3 -m bench.results_md",
                  file=sys.stderr)
        return 1 if stale or problems else 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)} ({len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
