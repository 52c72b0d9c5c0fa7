"""What every benchmark result records, and where results go.

Every driver under ``bench/`` and ``pdserve bench`` starts its JSON with :func:`header`:

- ``benchmark``: the driver's name (``gpu_engine``, ``kv_transfer_gpu``, ...);
- ``command``: the command line that produced the file, as it can be typed again from the
  repository root (``python3 -m bench.gpu_engine --sections a``, ``python3
  bench/disagg_gpu.py ...``, ``pdserve bench ...``), and ``env``: the settings taken from
  the environment (``PDSERVE_*``, ``NCCL_*``, ``CUDA_VISIBLE_DEVICES``, ``OTEL_*``, ...);
- ``commit`` and ``git``: the checkout's HEAD and whether the work tree differed from it
  (a GPU machine often runs a copy with changes not yet committed: ``git.changed_files``
  and ``git.diff_sha1`` then tell two such runs apart);
- ``config``: the resolved configuration (the driver's arguments after defaults);
- ``machine``: platform, CPUs, load, Python and the versions of the packages that decide
  the figures (torch, triton, grpcio, NCCL, NIXL), and the GPUs (``nvidia-smi``; a process
  that never opened a CUDA context does not open one here);
- ``date``: when the run started (ISO 8601, UTC offset);
- ``figures``: which values of the file are its headline figures (``bench/results_md.py``
  turns them into ``bench/RESULTS.md``).

Results are grouped in result sets, one folder each: ``bench/results/<benchmark>/<set>/``.
A driver given ``--set NAME`` writes there; ``--out PATH`` names the file instead.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
ENV_PREFIXES = ("PDSERVE_", "NCCL_", "TORCH_", "TRITON_", "CUDA_VISIBLE_DEVICES", "OTEL_",
                "OMP_NUM_THREADS", "NVSHMEM_", "UCX_")
PACKAGES = ("torch", "triton", "numpy", "grpcio", "protobuf", "transformers", "nixl-cu13",
            "nvidia-nccl-cu12", "nvidia-nccl-cu13", "uvloop")


@dataclass(frozen=True)
class Figure:
    """One headline value of a result file: ``path`` walks the JSON (keys, list indexes, or
    ``{"key": value}`` to pick the list item whose ``key`` equals ``value``); ``pattern``
    instead takes the first group of a regular expression over a text file (a test log)."""
    name: str
    unit: str = ""
    path: tuple = ()
    pattern: str = ""
    format: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"] = list(self.path)
        return {k: v for k, v in d.items() if v not in ("", [], ())}


def _run(cmd: list[str], cwd: Path = REPO, timeout: float = 20) -> str | None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state(repo: Path = REPO) -> dict:
    """HEAD of the checkout and how the work tree differs from it (tracked files only)."""
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    if commit is None:
        return {"commit": None, "dirty": None}
    # tracked files that differ from HEAD, staged or not (not `status --porcelain`, whose
    # lines start with a status column that the output's strip() ate on the first line)
    changed = _run(["git", "diff", "--name-only", "HEAD"], repo) or ""
    files = [line for line in changed.splitlines() if line.strip()]
    out: dict = {"commit": commit, "dirty": bool(files)}
    if files:
        diff = _run(["git", "diff", "HEAD"], repo) or ""
        out["changed_files"] = files[:50]
        out["diff_sha1"] = hashlib.sha1(diff.encode()).hexdigest()
    return out


def command_line(argv: list[str] | None = None, prog: str | None = None) -> str:
    """The command as typed from the repository root: ``prog`` if given (``pdserve
    bench``), else ``python3 -m <module>`` for a run with ``-m``, else ``python3 <script>``
    with the script's path relative to the repository."""
    args = list(sys.argv[1:] if argv is None else argv)
    if prog is None:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name:
            prog = f"python3 -m {spec.name}"
        else:
            script = Path(sys.argv[0]).resolve()
            try:
                script = script.relative_to(REPO)
            except ValueError:
                pass
            prog = f"python3 {script}"
    return " ".join([prog] + [shlex.quote(a) for a in args])


def settings_env() -> dict:
    """The environment settings that change what a benchmark measures."""
    from pdcore.config_tree import environ
    return {k: v for k, v in sorted(environ().items()) if k.startswith(ENV_PREFIXES)}


def _versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _gpus() -> list[str] | None:
    """``index, name, memory, driver`` per GPU from nvidia-smi (no CUDA context here)."""
    text = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                 "--format=csv,noheader"], timeout=30)
    return text.splitlines() if text else None


def cuda_details() -> dict | None:
    """torch's view of the GPUs (CUDA and NCCL versions, device names), asked in a child
    process so that this one never opens a CUDA context; None without CUDA."""
    code = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps({"
            "'cuda': torch.version.cuda, 'devices': [torch.cuda.get_device_name(i) for i in "
            "range(torch.cuda.device_count())] if ok else [], 'nccl': '.'.join(map(str, "
            "torch.cuda.nccl.version())) if ok else None}))")
    text = _run([sys.executable, "-c", code], timeout=120)
    try:
        info = json.loads(text) if text else None
    except ValueError:
        return None
    return info if info and info["devices"] else None


def machine(cuda: bool = False) -> dict:
    """Where the run happens. ``cuda``: also ask torch about the GPUs (in a child)."""
    out = {"platform": platform.platform(), "machine": platform.machine(),
           "python": platform.python_version(), "cpus": os.cpu_count(),
           "loadavg_start": [round(x, 2) for x in os.getloadavg()],
           "packages": _versions(), "gpus": _gpus()}
    if cuda:
        out["cuda"] = cuda_details()
    return out


def header(benchmark: str, config: dict | argparse.Namespace | None = None, *,
           argv: list[str] | None = None, prog: str | None = None, about: str = "",
           figures: tuple[Figure, ...] | list[Figure] = (), cuda: bool = False) -> dict:
    """The fields every result file starts with (see the module docstring)."""
    if isinstance(config, argparse.Namespace):
        config = vars(config)
    git = git_state()
    return {"benchmark": benchmark, "about": about.strip().split("\n\n")[0].strip(),
            "command": command_line(argv, prog), "env": settings_env(),
            "commit": git["commit"], "git": git, "config": _jsonable(config or {}),
            "machine": machine(cuda), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "figures": [f.to_json() for f in figures]}


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=repr))


# ------------------------------------------------------------------------------ output
def add_output_args(p: argparse.ArgumentParser, benchmark: str) -> None:
    """``--out FILE`` and ``--set NAME`` (bench/results/<benchmark>/<NAME>/)."""
    g = p.add_argument_group("output")
    from pdserve.argtypes import output_file
    g.add_argument("--out", default=None, type=output_file,
                   help=f"result file; default bench/results/{benchmark}/<--set>/"
                        f"{benchmark}.json")
    g.add_argument("--set", default=None, dest="result_set", type=set_name,
                   help="result set (folder) name under bench/results/" + benchmark +
                        "/ [<date>-<commit>]")


def set_name(text: str) -> str:
    """``--set``: one folder name under bench/results/<benchmark>/ (never a path out of it)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", text):
        raise argparse.ArgumentTypeError(f"expected a folder name (letters, digits, _ . -), "
                                         f"got {text!r}")
    return text


def output_path(args: argparse.Namespace, benchmark: str, filename: str | None = None) -> Path:
    """Where this run's result goes: ``--out`` if given, else its result set's folder."""
    if getattr(args, "out", None):
        return Path(args.out)
    name = getattr(args, "result_set", None) or default_set_name()
    return RESULTS / benchmark / name / (filename or f"{benchmark}.json")


def default_set_name() -> str:
    commit = (git_state().get("commit") or "nogit")[:7]
    return f"{time.strftime('%Y%m%d-%H%M')}-{commit}"


_SCALAR = r'(?:-?[0-9.]+(?:[eE][-+]?[0-9]+)?|true|false|null|"[^"\\,\[\]{}]*")'
_SCALAR_LIST = re.compile(r"\[\s*(" + _SCALAR + r"(?:\s*,\s*" + _SCALAR + r")*)\s*\]")


def dumps(doc: dict) -> str:
    """Indented JSON with lists of scalars (token ids, samples, request rows) on one line."""
    text = json.dumps(doc, indent=1, default=repr)
    return _SCALAR_LIST.sub(lambda m: "[" + ", ".join(
        x.strip() for x in re.split(r",\s*\n\s*", m.group(1))) + "]", text) + "\n"


def write_json(path: str | os.PathLike, doc: dict) -> Path:
    """Write ``doc`` (atomically: a killed run leaves the previous complete file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(doc))
    os.replace(tmp, path)
    return path


@dataclass
class Recorder:
    """A run's result document: the header, then whatever the driver adds; ``save()``
    rewrites the file (drivers save after every phase, so a killed run keeps its figures)."""
    path: Path
    doc: dict = field(default_factory=dict)

    @classmethod
    def start(cls, benchmark: str, args: argparse.Namespace, *, filename: str | None = None,
              **header_kw) -> "Recorder":
        cfg = {k: v for k, v in vars(args).items() if k not in ("out", "result_set")}
        return cls(output_path(args, benchmark, filename), header(benchmark, cfg, **header_kw))

    def save(self) -> Path:
        return write_json(self.path, self.doc)

    def __getitem__(self, key):
        return self.doc[key]

    def __setitem__(self, key, value) -> None:
        self.doc[key] = value


def torch_device(requested: str = "auto") -> str:
    """``cuda`` or ``cpu``: ``auto`` picks cuda when torch sees a GPU (this imports torch
    and asks CUDA, so a process meant to stay without a CUDA context passes its choice)."""
    if requested != "auto":
        return requested
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
