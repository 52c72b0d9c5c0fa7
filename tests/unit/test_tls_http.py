"""TLS on the gateway's HTTP front (gateway/openai/server.py) over real sockets: a real
uvicorn server on the event loop, the official openai client (an httpx client trusting the
CA) and curl --cacert; with a client CA, no connection without a client certificate of that
CA; certificate rotation without a restart."""
from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess

import openai
import pytest

from gateway.openai.server import HttpServer, ReloadingTls
from services import tls as T
from tests.unit.kvtransfer_helpers import run


@pytest.fixture(scope="module")
def cas(tmp_path_factory):
    a = T.write_cluster_files(str(tmp_path_factory.mktemp("http-a")))
    b = T.write_cluster_files(str(tmp_path_factory.mktemp("http-b")))
    return a, b


async def _models_app(scope, receive, send):
    """The smallest OpenAI-shaped ASGI app: GET /v1/models."""
    assert scope["type"] == "http"
    body = b'{"object": "list", "data": [{"id": "m", "object": "model", "created": 0, ' \
           b'"owned_by": "pdserve"}]}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _sdk(port, ca_file, client=None):
    ctx = ssl.create_default_context(cafile=ca_file)
    if client is not None:
        ctx.load_cert_chain(*client)
    return openai.OpenAI(base_url=f"https://localhost:{port}/v1", api_key="k", max_retries=0,
                         timeout=10, http_client=openai.DefaultHttpxClient(verify=ctx))


def _curl(*args):
    out = subprocess.run(["curl", "-sS", "--max-time", "10", *args], capture_output=True,
                         text=True, timeout=30)
    return out.returncode, out.stdout + out.stderr


def _serve(tls, probes):
    """Start the server, run the blocking ``probes(port)`` in a thread, stop it."""
    async def main():
        srv = HttpServer(_models_app, host="127.0.0.1", port=0, tls=tls)
        port = await srv.start()
        try:
            return await asyncio.to_thread(probes, port)
        finally:
            await srv.stop()
    return run(main(), "uvloop")


def _ids(port, ca, client=None):
    try:
        return [m.id for m in _sdk(port, ca, client).models.list()]
    except openai.APIConnectionError as e:
        return f"refused: {e.__cause__ or e}"


def test_https_with_the_gateway_certificate(cas):
    a, b = cas
    tls = ReloadingTls(a.cert("gateway"), a.key("gateway"))

    def probes(port):
        return (_ids(port, a.ca_file), _ids(port, b.ca_file),
                _curl("--cacert", a.ca_file, f"https://localhost:{port}/v1/models"),
                _curl(f"https://localhost:{port}/v1/models"),  # the system's CAs only
                _curl(f"http://localhost:{port}/v1/models"))  # plaintext
    ok, other_ca, curl_ok, curl_no_ca, plain = _serve(tls, probes)
    assert ok == ["m"]
    assert other_ca.startswith("refused") and "CERTIFICATE_VERIFY_FAILED" in other_ca
    assert curl_ok[0] == 0 and '"id": "m"' in curl_ok[1]
    assert curl_no_ca[0] == 60  # peer certificate cannot be authenticated
    assert plain[0] != 0 or '"id"' not in plain[1]


def test_a_client_ca_requires_a_client_certificate_of_that_ca(cas):
    a, b = cas
    tls = ReloadingTls(a.cert("gateway"), a.key("gateway"), b.ca_file)
    mine = (b.cert("operator"), b.key("operator"))
    theirs = (a.cert("operator"), a.key("operator"))  # a certificate of another CA

    def probes(port):
        url = f"https://localhost:{port}/v1/models"
        return (_ids(port, a.ca_file, mine), _ids(port, a.ca_file),
                _ids(port, a.ca_file, theirs),
                _curl("--cacert", a.ca_file, "--cert", mine[0], "--key", mine[1], url),
                _curl("--cacert", a.ca_file, url))
    with_cert, without, wrong, curl_ok, curl_without = _serve(tls, probes)
    assert with_cert == ["m"]
    assert isinstance(without, str) and without.startswith("refused"), without
    assert isinstance(wrong, str) and wrong.startswith("refused"), wrong
    assert curl_ok[0] == 0 and '"id": "m"' in curl_ok[1]
    assert curl_without[0] != 0 and '"id"' not in curl_without[1]


def test_a_new_certificate_is_served_without_a_restart(cas, tmp_path):
    a, b = cas
    for src, dst in ((a.cert("gateway"), "http.crt"), (a.key("gateway"), "http.key")):
        shutil.copy(src, tmp_path / dst)
    tls = ReloadingTls(str(tmp_path / "http.crt"), str(tmp_path / "http.key"), check_s=0.0)

    def probes(port):
        before = (_ids(port, a.ca_file), _ids(port, b.ca_file))
        for src, dst in ((b.cert("gateway"), "http.crt"), (b.key("gateway"), "http.key")):
            shutil.copy(src, tmp_path / f"{dst}.new")
        os.replace(tmp_path / "http.key.new", tmp_path / "http.key")
        os.replace(tmp_path / "http.crt.new", tmp_path / "http.crt")
        return before, (_ids(port, b.ca_file), _ids(port, a.ca_file))
    (old_a, old_b), (new_b, new_a) = _serve(tls, probes)
    assert old_a == ["m"] and old_b.startswith("refused")
    assert new_b == ["m"] and new_a.startswith("refused")


def test_metrics_port_over_tls_with_a_scraper_certificate(cas):
    """/metrics (prometheus_client's server) with metrics_tls_*: https with the given
    certificate, and with metrics_tls_ca_file only a scraper holding a client certificate of
    that CA reads it."""
    from prometheus_client import CollectorRegistry, Counter
    from services.config import ConfigError, worker_settings
    from services.metrics import serve_metrics
    from pdserve.cluster import free_port
    a, b = cas
    reg = CollectorRegistry()
    Counter("pdserve_tls_probe", "a probe", registry=reg).inc()
    s = worker_settings(["--metrics-tls-cert-file", a.cert("operator"), "--metrics-tls-key-file",
                         a.key("operator"), "--metrics-tls-ca-file", b.ca_file],
                        env={"PDSERVE_DEVICE": "cpu"})
    port = serve_metrics(reg, free_port(), "127.0.0.1", s)
    url = f"https://localhost:{port}/metrics"
    scraper = ("--cert", b.cert("operator"), "--key", b.key("operator"))
    ok = _curl("--cacert", a.ca_file, *scraper, url)
    assert ok[0] == 0 and "pdserve_tls_probe_total 1.0" in ok[1], ok
    no_cert = _curl("--cacert", a.ca_file, url)
    assert no_cert[0] != 0 and "pdserve_tls_probe" not in no_cert[1]
    plain = _curl(f"http://localhost:{port}/metrics")
    assert "pdserve_tls_probe" not in plain[1]
    with pytest.raises(ConfigError, match="go together"):
        worker_settings(["--metrics-tls-cert-file", a.cert("operator")],
                        env={"PDSERVE_DEVICE": "cpu"})
