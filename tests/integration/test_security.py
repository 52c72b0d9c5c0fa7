"""Secure by default (issue 23), tried as an attacker on the same network would, over real
sockets: a default LocalCluster (what ``pdserve up`` runs) with its throw-away CA, mutual TLS,
a Redis password and signed registry entries."""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading

import grpc
import pytest
import redis as redis_sync

from pdserve import client
from pdserve.cluster import REPO, LocalCluster, worker_channel
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.registry import WorkerInfo
from services.tls import CLUSTER_NAME, write_cluster_files
from tests.integration.helpers import gen_many, run

SP = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
RPC_NAMES = ("Decode.Generate", "Decode.GenerateMany", "Decode.Stats", "Decode.Abort",
             "Prefill.Prefill", "Prefill.Stats", "Prefill.Abort")


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster("dummy:tiny", prefill=1, decode=1) as c:
        yield c


class Listener:
    """A TCP port that counts who connects (a would-be target of request forgery)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self):
        self.sock.close()


def _rpcs(ch):
    dec, pre = worker_pb2_grpc.DecodeWorkerStub(ch), worker_pb2_grpc.PrefillWorkerStub(ch)
    return {
        "Decode.Generate": lambda: _drain(dec.Generate(worker_pb2.DecodeRequest(
            request_id="x", prompt_token_ids=[5, 6, 7], sampling=SP), timeout=10)),
        "Decode.GenerateMany": lambda: _drain(dec.GenerateMany(iter([
            worker_pb2.DecodeStreamRequest(call_id=1, start=worker_pb2.DecodeRequest(
                request_id="x", prompt_token_ids=[5, 6, 7], sampling=SP))]), timeout=10)),
        "Decode.Stats": lambda: dec.Stats(common_pb2.StatsRequest(), timeout=10),
        "Decode.Abort": lambda: dec.Abort(common_pb2.AbortRequest(request_id="x"), timeout=10),
        "Prefill.Prefill": lambda: pre.Prefill(worker_pb2.PrefillRequest(
            request_id="x", prompt_token_ids=[5, 6, 7], sampling=SP), timeout=10),
        "Prefill.Stats": lambda: pre.Stats(common_pb2.StatsRequest(), timeout=10),
        "Prefill.Abort": lambda: pre.Abort(common_pb2.AbortRequest(request_id="x"), timeout=10),
    }


async def _drain(call):
    return [r async for r in call]


async def _codes(make_channel, names):
    async with make_channel() as ch:
        rpcs = _rpcs(ch)
        out = {}
        for name in names:
            try:
                await rpcs[name]()
                out[name] = "OK"
            except grpc.aio.AioRpcError as e:
                out[name] = e.code().name
        return out


def _worker(cluster, kind):
    return next(w for w in cluster.workers if w.kind == kind)


def test_every_worker_rpc_refuses_a_client_without_a_cluster_certificate(cluster):
    other = write_cluster_files(tempfile.mkdtemp(prefix="other-ca-"))  # another cluster's
    ca = open(cluster.identity.ca_file, "rb").read()
    for w in cluster.workers:
        names = [n for n in RPC_NAMES if n.startswith("Decode" if w.kind == "decode"
                                                       else "Prefill")]
        plain = run(_codes(lambda: grpc.aio.insecure_channel(w.address), names))
        no_cert = run(_codes(lambda: grpc.aio.secure_channel(
            w.address, grpc.ssl_channel_credentials(root_certificates=ca),
            options=[("grpc.ssl_target_name_override", CLUSTER_NAME)]), names))
        foreign = run(_codes(lambda: worker_channel(w.address, "gateway", other), names))
        for got in (plain, no_cert, foreign):
            assert set(got.values()) == {"UNAVAILABLE"}, (w.kind, got)


def test_each_rpc_admits_only_its_roles(cluster):
    dec, pre = _worker(cluster, "decode"), _worker(cluster, "prefill")
    decode_rpcs = ["Decode.Generate", "Decode.GenerateMany", "Decode.Stats", "Decode.Abort"]
    prefill_rpcs = ["Prefill.Prefill", "Prefill.Stats", "Prefill.Abort"]
    by_role = {r: run(_codes(lambda: cluster.worker_channel(dec.address, r), decode_rpcs))
               for r in ("gateway", "operator", "prefill", "decode")}
    assert by_role["gateway"] == {"Decode.Generate": "OK", "Decode.GenerateMany": "OK",
                                  "Decode.Stats": "OK", "Decode.Abort": "OK"}
    assert by_role["operator"] == {"Decode.Generate": "PERMISSION_DENIED",
                                   "Decode.GenerateMany": "PERMISSION_DENIED",
                                   "Decode.Stats": "OK", "Decode.Abort": "PERMISSION_DENIED"}
    for role in ("prefill", "decode"):
        assert set(by_role[role].values()) == {"PERMISSION_DENIED"}, by_role[role]
    as_gateway = run(_codes(lambda: cluster.worker_channel(pre.address, "gateway"),
                            prefill_rpcs))
    assert as_gateway == {"Prefill.Prefill": "PERMISSION_DENIED", "Prefill.Stats": "OK",
                          "Prefill.Abort": "PERMISSION_DENIED"}
    # a decode worker's certificate gets past the role check (then the request's own checks)
    as_decode = run(_codes(lambda: cluster.worker_channel(pre.address, "decode"),
                           prefill_rpcs))
    assert as_decode["Prefill.Abort"] == "OK" and as_decode["Prefill.Stats"] == "OK"
    assert as_decode["Prefill.Prefill"] not in ("PERMISSION_DENIED", "UNAVAILABLE")


def _kv_endpoint(cluster) -> tuple[str, int]:
    r = redis_sync.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        dec = _worker(cluster, "decode")
        h = r.hgetall(f"pdserve:worker:{dec.worker_id}")
    finally:
        r.close()
    host, _, port = h["kv_endpoint"].removeprefix("tcp://").rpartition(":")
    return host, int(port)


def _hello_answered(sock) -> bytes:
    from kvtransfer import KVLayout, wire
    sock.sendall(wire.encode_hello(wire.KIND_TCP, KVLayout(2, 2, 16, 16, "float32"),
                                   "probe", 1))
    sock.settimeout(5)
    try:
        return sock.recv(64)
    except (ConnectionResetError, ssl.SSLError):
        return b""


def test_kv_receiver_refuses_a_sender_without_a_cluster_certificate(cluster):
    host, port = _kv_endpoint(cluster)
    ident = cluster.identity
    # plaintext: no answer, the connection is closed
    with socket.create_connection((host, port), timeout=5) as s:
        assert _hello_answered(s) == b""
    # TLS without a client certificate, and with a certificate of a role that sends no KV
    for cert in (None, "gateway", "decode"):
        ctx = ssl.create_default_context(cafile=ident.ca_file)
        if cert:
            ctx.load_cert_chain(ident.cert(cert), ident.key(cert))
        with socket.create_connection((host, port), timeout=5) as raw:
            try:
                with ctx.wrap_socket(raw, server_hostname=CLUSTER_NAME) as s:
                    assert _hello_answered(s) == b"", cert
            except (ssl.SSLError, ConnectionResetError):
                pass  # refused during the handshake
    # a prefill worker's certificate is answered (with an error about the made-up transfer)
    ctx = ssl.create_default_context(cafile=ident.ca_file)
    ctx.load_cert_chain(ident.cert("prefill"), ident.key("prefill"))
    with socket.create_connection((host, port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=CLUSTER_NAME) as s:
            assert _hello_answered(s) != b""


def test_workers_do_not_dial_unregistered_addresses(cluster):
    dec, pre = _worker(cluster, "decode"), _worker(cluster, "prefill")
    target = Listener()
    try:
        async def as_gateway():
            async with cluster.worker_channel(dec.address, "gateway") as ch:
                call = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(worker_pb2.DecodeRequest(
                    request_id="ssrf", prompt_token_ids=list(range(5, 60)), sampling=SP,
                    prefill_address=f"127.0.0.1:{target.port}"), timeout=20)
                try:
                    await _drain(call)
                    return "OK", ""
                except grpc.aio.AioRpcError as e:
                    return e.code().name, e.details()

        async def as_decode():
            from engine.loader import load_config
            from kvtransfer import KVLayout
            from services.kv_proto import layout_to_proto
            mc = load_config("dummy:tiny")
            layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, "float32")
            async with cluster.worker_channel(pre.address, "decode") as ch:
                try:
                    await worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
                        request_id="ssrf", prompt_token_ids=list(range(5, 40)), sampling=SP,
                        kv_transfer=common_pb2.KVTransferParams(
                            transfer_id="t", backend="tcp", num_blocks=3, timeout_ms=5000,
                            receiver_endpoint=f"tcp://127.0.0.1:{target.port}",
                            layout=layout_to_proto(layout))), timeout=20)
                    return "OK", ""
                except grpc.aio.AioRpcError as e:
                    return e.code().name, e.details()

        code, msg = run(as_gateway())
        assert code == "PERMISSION_DENIED" and "not a registered member" in msg, (code, msg)
        code, msg = run(as_decode())
        assert code == "PERMISSION_DENIED" and "not a registered member" in msg, (code, msg)
        assert target.connections == 0
    finally:
        target.close()


def test_redis_refuses_a_client_without_the_password(cluster):
    # the address and the CA to trust, without the password
    r = redis_sync.Redis.from_url(cluster.redis.url, ssl_ca_certs=cluster.identity.ca_file)
    try:
        with pytest.raises(redis_sync.exceptions.AuthenticationError):
            r.ping()
        with pytest.raises(redis_sync.exceptions.AuthenticationError):
            r.hset("pdserve:worker:evil", mapping={"address": "127.0.0.1:1"})
    finally:
        r.close()


def test_redis_speaks_tls_only_and_the_cluster_registers_and_routes_through_it(cluster):
    """The default cluster's Redis is a real redis-server listening for TLS only
    (rediss://, a certificate of the cluster CA's ``redis`` role): the workers registered
    through it (signed entries), the gateway routes with them; a client that does not trust
    the CA, or speaks plaintext, gets nowhere even with the password."""
    assert cluster.redis.url.startswith("rediss://")
    password = open(cluster.identity.redis_password_file).read().strip()
    r = redis_sync.Redis.from_url(cluster.redis.client_url, decode_responses=True)
    try:
        ids = r.smembers("pdserve:workers")
        assert {w.worker_id for w in cluster.workers} <= ids
        for w in cluster.workers:
            assert r.hget(f"pdserve:worker:{w.worker_id}", "sig")  # signed, written over TLS
    finally:
        r.close()
    outs = run(gen_many(cluster.address, [client.make_request(
        prompt=f"rediss {i} " * 6, max_tokens=4, temperature=0.0) for i in range(4)], timeout=60))
    assert all(o.finish_reason == "length" for o in outs), outs
    port = cluster.redis.port
    for url, kw, exc in (
            (f"rediss://:{password}@127.0.0.1:{port}/0", {}, redis_sync.exceptions.ConnectionError),
            (f"rediss://:{password}@127.0.0.1:{port}/0",
             {"ssl_ca_certs": write_cluster_files(tempfile.mkdtemp()).ca_file},  # another CA
             redis_sync.exceptions.ConnectionError),
            (f"redis://:{password}@127.0.0.1:{port}/0", {}, redis_sync.exceptions.ConnectionError)):
        bad = redis_sync.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3, **kw)
        try:
            with pytest.raises(exc):
                bad.ping()
        finally:
            bad.close()


def test_forged_registry_entries_receive_no_request(cluster):
    """A Redis writer (it knows the password) adds a fake idle decode worker and a copy of
    the real one pointing elsewhere: neither gets a single request."""
    target = Listener()
    dec = _worker(cluster, "decode")
    r = redis_sync.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        real = r.hgetall(f"pdserve:worker:{dec.worker_id}")
        fake = WorkerInfo(worker_id="evil-1", address=f"127.0.0.1:{target.port}",
                          role="decode", model=real["model"], capacity=512,
                          max_model_len=int(real["max_model_len"]),
                          kv_endpoint=f"tcp://127.0.0.1:{target.port}").to_hash()
        copied = {**real, "worker_id": "evil-2", "address": f"127.0.0.1:{target.port}",
                  "running": "0", "waiting": "0"}
        for h in (fake, copied):
            r.hset(f"pdserve:worker:{h['worker_id']}", mapping=h)
            r.sadd("pdserve:workers", h["worker_id"])

        async def refresh_for(seconds):  # keep them alive while the gateway looks
            for _ in range(int(seconds * 4)):
                for h in (fake, copied):
                    r.pexpire(f"pdserve:worker:{h['worker_id']}", 3000)
                await asyncio.sleep(0.25)

        async def main():
            keep = asyncio.ensure_future(refresh_for(30))
            await asyncio.sleep(2.5)  # gateway refreshes every second
            reqs = [client.make_request(prompt=f"forged {i} " * 8, max_tokens=4,
                                        temperature=0.0) for i in range(10)]
            try:
                return await gen_many(cluster.address, reqs, timeout=60)
            finally:
                keep.cancel()
        outs = run(main())
        assert all(o.finish_reason == "length" for o in outs), outs
        assert target.connections == 0
        log = "\n".join(cluster.gateway.log)
        assert "ignoring registry entry evil-1" in log and "ignoring registry entry evil-2" \
            in log, log[-2000:]
    finally:
        for wid in ("evil-1", "evil-2"):
            r.delete(f"pdserve:worker:{wid}")
            r.srem("pdserve:workers", wid)
        r.close()
        target.close()


def test_no_secret_on_a_command_line_or_in_a_log(cluster):
    password = open(cluster.identity.redis_password_file).read().strip()
    procs = [cluster.gateway.proc.pid, *(w.proc.pid for w in cluster.workers),
             cluster.redis.proc.pid]
    for pid in procs:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert password.encode() not in f.read()
    for svc in [cluster.gateway, *cluster.workers]:
        assert password not in "\n".join(svc.log)
    shown = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "config", "show", "--role", "gateway",
         "--redis-url", f"redis://:{password}@127.0.0.1:1/0"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
        timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert password not in shown.stdout and "<redacted>" in shown.stdout


def test_insecure_cluster_still_serves():
    with LocalCluster("dummy:tiny", prefill=1, decode=1, secure=False) as c:
        outs = run(gen_many(c.address, [client.make_request(prompt="plain " * 20, max_tokens=4,
                                                            temperature=0.0)] * 2, timeout=60))
        assert [o.finish_reason for o in outs] == ["length", "length"]
        dec = _worker(c, "decode")
        got = run(_codes(lambda: grpc.aio.insecure_channel(dec.address), ["Decode.Stats"]))
        assert got == {"Decode.Stats": "OK"}
        r = redis_sync.Redis.from_url(c.redis.url)  # no password in an insecure cluster
        try:
            assert r.ping()
        finally:
            r.close()


def test_pdserve_up_is_secure_by_default_and_insecure_on_request():
    for flags, want in (([], "mutual TLS"), (["--insecure"], "INSECURE")):
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "up", "--model", "dummy:tiny", "--port", "0",
             "--exit-after-demo", *flags],
            capture_output=True, text=True, cwd=REPO, timeout=240,
            env={**os.environ, "PYTHONPATH": REPO})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert want in out.stdout and "finish=" in out.stdout, out.stdout[-2000:]


def test_the_http_front_serves_the_client_port_certificate_and_requires_client_certs():
    """The gateway's OpenAI HTTP port takes the gRPC client port's TLS settings: the same
    certificate, and with client_tls_ca_file a client certificate of that CA on both ports.
    The official openai client (an httpx client trusting the CA, with a client certificate)
    and curl --cacert --cert get through; without the client certificate, nothing."""
    import openai
    front = write_cluster_files(tempfile.mkdtemp(prefix="front-"))  # client-facing PKI
    users = write_cluster_files(tempfile.mkdtemp(prefix="users-"))  # who may call
    args = ("--client-tls-cert-file", front.cert("gateway"), "--client-tls-key-file",
            front.key("gateway"), "--client-tls-ca-file", users.ca_file)
    mine = (users.cert("operator"), users.key("operator"))
    with LocalCluster("dummy:tiny", prefill=1, decode=1, http_port=0,
                      gateway_args=args) as c:
        port = c.gateway.http_port
        url = f"https://localhost:{port}/v1"

        def sdk(cert=None):
            ctx = ssl.create_default_context(cafile=front.ca_file)
            if cert:
                ctx.load_cert_chain(*cert)
            return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60,
                                 http_client=openai.DefaultHttpxClient(verify=ctx))
        models = [m.id for m in sdk(mine).models.list()]
        assert models, models
        done = sdk(mine).completions.create(model=models[0], prompt="hello over https",
                                            max_tokens=4, temperature=0.0)
        assert done.choices[0].finish_reason == "length", done
        with pytest.raises(openai.APIConnectionError):
            sdk().models.list()  # no client certificate
        ok = subprocess.run(["curl", "-sS", "--max-time", "20", "--cacert", front.ca_file,
                             "--cert", mine[0], "--key", mine[1], f"{url}/models"],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and models[0] in ok.stdout, ok.stdout + ok.stderr
        refused = subprocess.run(["curl", "-sS", "--max-time", "20", "--cacert",
                                  front.ca_file, f"{url}/models"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and models[0] not in refused.stdout
        plain = subprocess.run(["curl", "-sS", "--max-time", "20",
                                f"http://127.0.0.1:{port}/v1/models"],
                               capture_output=True, text=True, timeout=60)
        assert models[0] not in plain.stdout
