"""Client authentication at the gateway (services/auth.py): a real cluster started with API
keys, real gRPC calls with and without them."""
from __future__ import annotations

import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest

from pdserve import client
from pdserve.cluster import REPO, LocalCluster
from protos.pdserve.v1 import gateway_pb2_grpc
from tests.integration.helpers import run, scrape

KEY_FILE_KEY = "file-key-0123456789"
ENV_KEY = "env-key-abcdef"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("auth") / "keys"
    key_file.write_text(f"# gateway keys\n{KEY_FILE_KEY}\n\n")
    with LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=1, metrics=True,
                      gateway_args=("--api-key-file", str(key_file)),
                      env={"PDSERVE_API_KEYS": ENV_KEY, "PDSERVE_API_KEY": ""}) as c:
        yield c


async def _generate(address, api_key=None, metadata=None):
    async with client.channel(address, api_key=api_key) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        out = []
        async for resp in stub.Generate(client.make_request("hi", max_tokens=3), timeout=60,
                                        metadata=metadata):
            out.extend(resp.token_ids)
        return out


def _refused(address, **kw) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(_generate(address, **kw))
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    return e.value


def test_calls_without_a_valid_key_are_refused(secured):
    err = _refused(secured.address, api_key="")
    assert "missing API key" in err.details() and "authorization: Bearer" in err.details()
    assert "invalid API key" in _refused(secured.address, api_key="not-a-key").details()
    assert "invalid API key" in _refused(secured.address, api_key=KEY_FILE_KEY + "x").details()
    # a scheme other than Bearer is not a key
    err = _refused(secured.address, api_key="", metadata=(("authorization", f"Basic {ENV_KEY}"),))
    assert "missing API key" in err.details()


def test_every_configured_key_is_accepted(secured):
    assert len(run(_generate(secured.address, api_key=KEY_FILE_KEY))) == 3  # from the file
    assert len(run(_generate(secured.address, api_key=ENV_KEY))) == 3  # from PDSERVE_API_KEYS
    assert len(run(_generate(secured.address, api_key="",
                             metadata=(("x-api-key", ENV_KEY),)))) == 3


def test_health_needs_no_key_and_refusals_are_counted(secured):
    async def health():
        async with grpc.aio.insecure_channel(secured.address) as ch:
            return await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5)
    assert run(health()).status == health_pb2.HealthCheckResponse.SERVING
    before = _unauthenticated(secured.gateway.metrics_port)
    _refused(secured.address, api_key="wrong")
    assert _unauthenticated(secured.gateway.metrics_port) == before + 1


def _unauthenticated(port: int) -> float:
    return scrape(port).get(("pdserve_requests_total", (("code", "UNAUTHENTICATED"),)), 0.0)


def test_cli_client_sends_its_key(secured):
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "hello", "--max-tokens", "2",
           "--address", secured.address]
    ok = subprocess.run(cmd + ["--api-key", ENV_KEY], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO})
    assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr


def test_unreadable_key_file_is_a_config_error(tmp_path):
    from services.config import ConfigError, gateway_settings
    with pytest.raises((ConfigError, ValueError), match="api_key_file"):
        gateway_settings(["--decode-addrs", "127.0.0.1:1", "--api-key-file",
                          str(tmp_path / "missing")], env={})
    with pytest.raises((ConfigError, ValueError), match="whitespace"):
        gateway_settings(["--decode-addrs", "127.0.0.1:1", "--api-keys", "a b"], env={})
    s = gateway_settings(["--decode-addrs", "127.0.0.1:1"], env={"PDSERVE_API_KEYS": "k1,k2"})
    assert s.api_keys == ("k1", "k2") and "k1" not in repr(s)
