"""bench/: the committed results and their index.

- bench/RESULTS.md is what ``python3 -m bench.results_md`` generates from the result sets
  (a result added, moved or deleted without regenerating it fails here), and every result
  file is described (a harness header or its set's set.json) with figures that resolve;
- no file under bench/ edits ``sys.path`` (drivers import the package: ``python3 -m
  bench.X`` from the repository root, or PYTHONPATH=. for ``python3 bench/X.py``);
- the harness header records the command, commit, configuration, machine and date, and a
  driver run writes into its result set's folder.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import results_md
from pdserve.benchlib import harness

REPO = Path(__file__).resolve().parents[2]


def test_results_md_is_generated_from_the_result_sets_and_not_stale():
    text, problems = results_md.render(results_md.load_sets())
    assert problems == []
    assert (REPO / "bench" / "RESULTS.md").read_text() == text, \
        "bench/RESULTS.md is stale: run python3 -m bench.results_md"


def test_every_result_set_is_well_formed():
    sets = results_md.load_sets()
    names = {(s.benchmark, s.name) for s in sets}
    assert ("gpu_engine", "h200-v4") in names and ("disagg_gpu", "h200-s11") in names
    hexsha = re.compile(r"[0-9a-f]{40}")
    for side in (REPO / "bench" / "results").glob("*/*/set.json"):
        doc = json.loads(side.read_text())
        for name, rec in doc["files"].items():
            for key in ("added_in", "last_changed_in", "measured_at"):
                if rec.get(key) is not None:
                    assert hexsha.fullmatch(rec[key]), (side, name, key)
            if "figures" not in rec or "added_in" not in rec:
                continue  # a header file whose sidecar entry picks figures only
            assert rec["command"] and rec["machine"] and rec["date"], (side, name)


def test_a_stale_or_broken_index_is_found(tmp_path):
    """The check the freshness test relies on: a figure that no longer resolves, a file
    nobody describes and a file outside any set are problems; a new harness file is listed."""
    root = tmp_path / "results"
    (root / "demo" / "one").mkdir(parents=True)
    (root / "demo" / "one" / "set.json").write_text(json.dumps({"about": "x", "files": {
        "a.json": {"command": "c", "machine": "m", "date": "d",
                   "figures": [{"name": "f", "path": ["v"]}, {"name": "g", "path": ["w"]}]}}}))
    (root / "demo" / "one" / "a.json").write_text('{"v": 1.5}')
    (root / "demo" / "one" / "b.log").write_text("x")
    (root / "loose.json").write_text("{}")
    head = harness.header("demo", {"k": 1}, argv=["--k", "1"],
                          figures=[harness.Figure("v", "ms", ("v",))])
    (root / "demo" / "two").mkdir()
    (root / "demo" / "two" / "r.json").write_text(json.dumps({**head, "v": 2.25}))
    sets = results_md.load_sets(root)
    text, problems = results_md.render(sets)
    assert any("'g'" in p for p in problems)
    assert any("b.log" in p and "neither" in p for p in problems)
    assert any("loose.json" in p and "outside" in p for p in problems)
    assert "f: **1.5**" in text and "v: **2.25 ms**" in text
    assert head["command"].endswith("--k 1") and "(recorded by the run)" in text


def test_no_file_under_bench_edits_sys_path():
    offenders = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    a.name in ("site",) for a in node.names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports site")
    assert offenders == []


def test_header_records_command_commit_config_machine_date():
    h = harness.header("demo", {"rate": 2.0}, argv=["--rate", "2"], prog="python3 -m bench.demo",
                       about="First line.\n\nMore.", figures=[harness.Figure("x", "ms", ("a",))])
    assert h["command"] == "python3 -m bench.demo --rate 2"
    assert h["config"] == {"rate": 2.0} and h["about"] == "First line."
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True)
    if head.returncode == 0:
        assert h["commit"] == head.stdout.strip() and isinstance(h["git"]["dirty"], bool)
    assert h["machine"]["cpus"] and h["machine"]["python"] and h["machine"]["packages"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", h["date"])
    assert h["figures"] == [{"name": "x", "unit": "ms", "path": ["a"]}]


def test_a_driver_writes_its_result_set(tmp_path, monkeypatch):
    """bench/kv_block_runs.py (CPU, a few seconds): --set writes bench/results/<driver>/<set>/
    (here redirected to a temporary folder) with the header, and results_md lists it."""
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    from bench import kv_block_runs
    doc = kv_block_runs.main(["--duration", "8", "--settle", "2", "--set", "demo"])
    out = tmp_path / "kv_block_runs" / "demo" / "kv_block_runs.json"
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "kv_block_runs" and saved["config"]["duration"] == 8.0
    assert saved["command"].endswith("--duration 8 --settle 2 --set demo")
    assert saved["summary"] == doc["summary"]
    text, problems = results_md.render(results_md.load_sets(tmp_path))
    assert problems == [] and "pieces per 4096-token transfer" in text


@pytest.mark.slow
def test_cpu_drivers_run_briefly(tmp_path):
    """Each CPU driver end to end at small sizes, as a module from the repository root."""
    runs = {
        "kv_transfer_cpu": ["--tokens", "64", "--runs", "1", "--warmup", "0"],
        "detokenizer_cpu": ["--tokens", "600"],
        "engine_host_cpu": ["--cases", "4:16:2"],
        "ttft_breakdown": ["--model", "dummy:tiny", "--requests", "1", "--warmup", "1",
                           "--prompt-len", "32"],
        "openai_front_cpu": ["--pairs", "1", "--requests", "4", "--ttft-requests", "2",
                             "--max-tokens", "4"],
        "tls_ceiling_cpu": ["--mib", "4", "--rounds", "1", "--repeats", "1"],
    }
    for name, args in runs.items():
        out = tmp_path / f"{name}.json"
        r = subprocess.run([sys.executable, "-m", f"bench.{name}", *args, "--out", str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert json.loads(out.read_text())["benchmark"] == name


def test_git_state_names_each_changed_file_whole(tmp_path):
    """A result's header names the files that differ from HEAD, every path complete (the
    first one lost its first letter when the status lines were stripped)."""
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    for name in ("pdserve.py", "zz.py"):
        (tmp_path / name).write_text("a\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert harness.git_state(tmp_path)["dirty"] is False
    (tmp_path / "pdserve.py").write_text("b\n")
    (tmp_path / "zz.py").write_text("b\n")
    git("add", "zz.py")  # staged counts too
    (tmp_path / "untracked.py").write_text("c\n")  # not tracked: not named
    state = harness.git_state(tmp_path)
    assert state["dirty"] is True
    assert state["changed_files"] == ["pdserve.py", "zz.py"]


def test_cpu_ratios_of_a_run_too_short_for_the_clock_are_none():
    """A brief run can measure 0 ms of gateway CPU; its ratio is None, not a ZeroDivisionError."""
    from bench import openai_front_cpu
    pair = {"throughput_ratio": 1.0, "added_ttft_p50_ms": 0.5,
            "load_grpc": {"gateway_cpu_ms_per_request": 0.0},
            "load_openai": {"gateway_cpu_ms_per_request": 2.5}}
    assert openai_front_cpu.summary([pair])["gateway_cpu_ratio"] is None
    pair["load_grpc"]["gateway_cpu_ms_per_request"] = 1.25
    assert openai_front_cpu.summary([pair])["gateway_cpu_ratio"] == 2.0
