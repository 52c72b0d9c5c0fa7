"""The committed generated code must be exactly what scripts/gen_protos.sh produces now."""
from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) regenerates the protos")

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos" / "pdserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _generated(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.name.endswith(GENERATED_SUFFIXES)}


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, timeout=60,
                   env=dict(os.environ, PYTHON=sys.executable))
    fresh = _generated(tmp_path / "protos" / "pdserve" / "v1")
    committed = _generated(PROTO_DIR)
    assert fresh, "gen_protos.sh produced nothing"
    assert sorted(committed) == sorted(fresh), "generated file set differs: run scripts/gen_protos.sh"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run scripts/gen_protos.sh and commit"


def test_generated_modules_import_and_name_the_wire_api():
    from protos.pdserve.v1 import (common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2,
                                   worker_pb2_grpc)

    services = {s.full_name: [m.name for m in s.methods]
                for mod in (gateway_pb2, worker_pb2)
                for s in mod.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "pdserve.v1.Gateway": ["Generate"],
        "pdserve.v1.PrefillWorker": ["Prefill", "Stats", "Abort"],
        "pdserve.v1.DecodeWorker": ["Generate", "GenerateMany", "Stats", "Abort"],
    }
    assert gateway_pb2_grpc.GatewayStub and worker_pb2_grpc.DecodeWorkerStub
    req = gateway_pb2.GenerateRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, stop=["\n"]))
    back = gateway_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert list(back.prompt_token_ids) == [1, 2, 3]
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")  # unset: server default
