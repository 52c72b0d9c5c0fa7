"""services/tls.py and kvtransfer/secure.py over real sockets: certificates and their roles,
mutual TLS on gRPC and on the KV control connection, rotation without a restart, signed
registry entries, Redis credentials, API key hashes, the loopback rule."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest
import torch

from kvtransfer import KVLayout, TransferState, make_receiver, make_sender
from kvtransfer.api import KVTransferOptions, ListenAddress
from services import tls as T
from services.config import ConfigError, gateway_settings, worker_settings
from services.grpc_server import ChannelPool, GrpcServer
from tests.unit.kvtransfer_helpers import cache, run

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


@pytest.fixture(scope="module")
def two_cas(tmp_path_factory):
    a = T.write_cluster_files(str(tmp_path_factory.mktemp("ca-a")))
    b = T.write_cluster_files(str(tmp_path_factory.mktemp("ca-b")))
    return a, b


def identity(files, role, tmp_path, name=None):
    """A service's own copy of ``files``' CA and ``role`` certificate (rotatable)."""
    d = tmp_path / (name or role)
    d.mkdir(exist_ok=True)
    install(files, role, d)
    return T.ClusterTls(str(d / "ca.crt"), str(d / "svc.crt"), str(d / "svc.key"),
                        check_s=0.1), d


def install(files, role, d):
    for src, dst in ((files.ca_file, "ca.crt"), (files.cert(role), "svc.crt"),
                     (files.key(role), "svc.key")):
        shutil.copy(src, d / f"{dst}.new")
        os.replace(d / f"{dst}.new", d / dst)  # atomic, as a Secret update is


def test_certificates_carry_their_role_and_bad_material_is_refused(two_cas, tmp_path):
    a, b = two_cas
    t, _ = identity(a, "decode", tmp_path)
    assert t.role == "decode" and T.pem_role(open(a.cert("gateway"), "rb").read()) == "gateway"
    with pytest.raises(T.TlsError, match="not signed by the CA"):
        T.ClusterTls(a.ca_file, b.cert("decode"), b.key("decode"))
    with pytest.raises(T.TlsError, match="is not the key of"):
        T.ClusterTls(a.ca_file, a.cert("decode"), a.key("prefill"))
    with pytest.raises(T.TlsError, match="cannot read tls_cert_file"):
        T.ClusterTls(a.ca_file, str(tmp_path / "nope.crt"), a.key("decode"))
    with pytest.raises(T.TlsError, match="role must be one of"):
        T.mint_cert(*T.mint_ca(), role="root")


async def _health(address, tls_client):
    pool = ChannelPool(health_pb2_grpc.HealthStub, tls=tls_client)
    try:
        resp = await pool.stub(address).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.aio.AioRpcError as e:
        return e.code().name
    finally:
        await pool.close()


def test_grpc_mutual_tls_and_rotation_without_restart(two_cas, tmp_path):
    a, b = two_cas

    async def main():
        server_tls, d = identity(a, "decode", tmp_path, "server")
        srv = GrpcServer([], host="127.0.0.1", port=0, credentials=server_tls.server_credentials(),
                         interceptors=[T.RoleInterceptor()])
        await srv.start()
        addr = srv.address
        client_a, _ = identity(a, "gateway", tmp_path, "client-a")
        client_b, _ = identity(b, "gateway", tmp_path, "client-b")
        try:
            before = (await _health(addr, client_a), await _health(addr, client_b))
            install(b, "decode", d)  # the server's files now hold cluster B's identity
            await asyncio.sleep(1.3)
            after = (await _health(addr, client_a), await _health(addr, client_b))
        finally:
            await srv.stop(0)
        return before, after

    before, after = run(main(), "asyncio")
    assert before == ("SERVING", "UNAVAILABLE")
    assert after == ("UNAVAILABLE", "SERVING")


def test_channel_pool_picks_up_a_rotated_client_certificate(two_cas, tmp_path):
    a, b = two_cas

    async def main():
        server_tls, _ = identity(b, "decode", tmp_path, "server")
        srv = GrpcServer([], host="127.0.0.1", port=0, credentials=server_tls.server_credentials())
        await srv.start()
        client, d = identity(a, "gateway", tmp_path, "client")
        pool = ChannelPool(health_pb2_grpc.HealthStub, tls=client)
        try:
            async def check():
                try:
                    await pool.stub(srv.address).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return "OK"
                except grpc.aio.AioRpcError as e:
                    return e.code().name
            first = await check()
            install(b, "gateway", d)
            await asyncio.sleep(0.3)
            return first, await check()
        finally:
            await pool.close()
            await srv.stop(0)

    assert run(main(), "asyncio") == ("UNAVAILABLE", "OK")


def test_a_refused_streaming_call_is_permission_denied_every_time(two_cas, tmp_path):
    """DecodeWorker.GenerateMany (requests streamed) from a role it does not admit: the
    caller sees PERMISSION_DENIED on every try, never INTERNAL (a refusal that finished the
    call while the client was still writing came back as INTERNAL in CI), also when the
    caller keeps its request stream open; an admitted role is served."""
    from protos.pdserve.v1 import worker_pb2
    a, _ = two_cas

    async def echo(requests, context):
        async for r in requests:
            yield worker_pb2.DecodeStreamResponse(
                entries=[worker_pb2.DecodeStreamEntry(call_id=r.call_id, end=True)])

    handler = grpc.method_handlers_generic_handler("pdserve.v1.DecodeWorker", {
        "GenerateMany": grpc.stream_stream_rpc_method_handler(
            echo, request_deserializer=worker_pb2.DecodeStreamRequest.FromString,
            response_serializer=worker_pb2.DecodeStreamResponse.SerializeToString)})
    method = "/pdserve.v1.DecodeWorker/GenerateMany"

    async def call(channel, requests):
        stream = channel.stream_stream(
            method, request_serializer=worker_pb2.DecodeStreamRequest.SerializeToString,
            response_deserializer=worker_pb2.DecodeStreamResponse.FromString)
        try:
            return [e.call_id async for r in stream(requests, timeout=10) for e in r.entries]
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def held_open():
        yield worker_pb2.DecodeStreamRequest(call_id=7)
        await asyncio.sleep(30)

    # messages large enough that the writes are still under way when a refusal at once ends
    # the call (grpc/grpc#36066)
    big = worker_pb2.DecodeRequest(request_id="x", prompt_token_ids=list(range(20_000)))

    async def main():
        server_tls, _ = identity(a, "decode", tmp_path, "server")
        srv = GrpcServer([], host="127.0.0.1", port=0, credentials=server_tls.server_credentials(),
                         interceptors=[T.RoleInterceptor()])
        srv.server.add_generic_rpc_handlers((handler,))
        await srv.start()
        chans = {r: identity(a, r, tmp_path, f"client-{r}")[0] for r in ("gateway", "prefill")}
        try:
            out = {}
            for role, t in chans.items():
                creds, _ = t.channel_credentials()
                async with grpc.aio.secure_channel(srv.address, creds, options=[
                        ("grpc.ssl_target_name_override", T.CLUSTER_NAME)]) as ch:
                    out[role] = [await call(ch, iter([worker_pb2.DecodeStreamRequest(
                        call_id=i, start=big) for _ in range(8)])) for i in range(25)]
                    if role == "prefill":
                        t0 = time.monotonic()
                        out["held open"] = await call(ch, held_open())
                        out["held open s"] = time.monotonic() - t0
            return out
        finally:
            await srv.stop(0)

    out = run(main(), "asyncio")
    assert out["gateway"] == [[i] * 8 for i in range(25)]
    assert out["prefill"] == ["PERMISSION_DENIED"] * 25
    assert out["held open"] == "PERMISSION_DENIED" and out["held open s"] < 5


async def _transfer(rx_tls, tx_tls, tid):
    src, dst = cache(LAYOUT, 16, seed=3), cache(LAYOUT, 16)
    rx = make_receiver("tcp", dst, LAYOUT, shared=KVTransferOptions(tls=rx_tls),
                       listen=ListenAddress())
    await rx.start()
    tx = make_sender("tcp", src, LAYOUT, shared=KVTransferOptions(tls=tx_tls))
    try:
        handle = rx.expect(tid, [4, 5, 6], timeout_s=5)
        res = await tx.send(tid, rx.endpoint, [1, 2, 9], timeout_s=5)
        if res.state is TransferState.DONE:
            got = await handle.wait()
            assert got.state is TransferState.DONE and torch.equal(dst[[4, 5, 6]], src[[1, 2, 9]])
        return res.state, res.error
    finally:
        await tx.close()
        await rx.close()


def test_a_hung_kv_receiver_costs_the_connect_bound_then_fails_at_once(two_cas, tmp_path,
                                                                      monkeypatch):
    """A receiver whose port accepts but never answers (a partition behind a proxy, a hung
    process): the sender gives up on the connection after CONNECT_TIMEOUT_S, not at the
    transfer's deadline, and for UNREACHABLE_COOLDOWN_S sends to it fail at once; other
    receivers are unaffected, and after the cooldown it is tried again."""
    import socket
    from kvtransfer import control
    monkeypatch.setattr(control, "CONNECT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(control, "UNREACHABLE_COOLDOWN_S", 1.0)
    a, _ = two_cas
    tx_tls, _ = identity(a, "prefill", tmp_path, "tx")
    rx_tls, _ = identity(a, "decode", tmp_path, "rx")

    async def timed(tx, tid, endpoint):
        t0 = time.monotonic()
        res = await tx.send(tid, endpoint, [1], timeout_s=30)
        return res, time.monotonic() - t0

    async def main():
        hung = socket.create_server(("127.0.0.1", 0))  # never accepted: no TLS handshake
        endpoint = f"tcp://127.0.0.1:{hung.getsockname()[1]}"
        good = make_receiver("tcp", cache(LAYOUT, 16), LAYOUT, listen=ListenAddress(),
                             shared=KVTransferOptions(tls=rx_tls))
        await good.start()
        tx = make_sender("tcp", cache(LAYOUT, 16, seed=3), LAYOUT,
                         shared=KVTransferOptions(tls=tx_tls))
        try:
            out = [await timed(tx, "first", endpoint), await timed(tx, "second", endpoint)]
            handle = good.expect("other", [2], timeout_s=5)
            out.append(await timed(tx, "other", good.endpoint))
            assert (await handle.wait()).state is TransferState.DONE
            await asyncio.sleep(1.1)
            out.append(await timed(tx, "again", endpoint))
            return out
        finally:
            await tx.close()
            await good.close()
            hung.close()

    (first, t1), (second, t2), (other, t3), (again, t4) = run(main())
    assert first.state is TransferState.FAILED and 0.4 < t1 < 3, (first, t1)
    assert "no connection within 0.5s" in first.error
    assert second.state is TransferState.FAILED and t2 < 0.2 and "unreachable" in second.error
    assert other.state is TransferState.DONE, other
    assert again.state is TransferState.FAILED and t4 > 0.4, (again, t4)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_kv_transfer_over_mutual_tls_admits_only_kv_roles(two_cas, tmp_path, loop):
    a, b = two_cas
    rx_tls, _ = identity(a, "decode", tmp_path, "rx")
    tx_tls, _ = identity(a, "prefill", tmp_path, "tx")
    assert run(_transfer(rx_tls, tx_tls, "ok"), loop)[0] is TransferState.DONE
    # a sender of another cluster, a gateway's certificate, a receiver that is no receiver
    foreign, _ = identity(b, "prefill", tmp_path, "foreign")
    gateway, _ = identity(a, "gateway", tmp_path, "gw")
    bad_rx, _ = identity(a, "prefill", tmp_path, "bad-rx")
    for rx, tx in ((rx_tls, foreign), (rx_tls, gateway), (bad_rx, tx_tls)):
        state, error = run(_transfer(rx, tx, "bad"), loop)
        assert state is TransferState.FAILED, (state, error)
    state, error = run(_transfer(bad_rx, tx_tls, "bad"), loop)
    assert "only decode, colocated may connect" in error


def test_kv_receiver_rotation_without_restart(two_cas, tmp_path):
    a, b = two_cas

    async def main():
        rx_tls, d = identity(a, "decode", tmp_path, "rx")
        src, dst = cache(LAYOUT, 16, seed=4), cache(LAYOUT, 16)
        rx = make_receiver("tcp", dst, LAYOUT, shared=KVTransferOptions(tls=rx_tls))
        await rx.start()
        tx_a, _ = identity(a, "prefill", tmp_path, "tx-a")
        tx_b, _ = identity(b, "prefill", tmp_path, "tx-b")
        out = []
        try:
            for step in range(2):
                if step:
                    install(b, "decode", d)
                    await asyncio.sleep(0.3)
                for name, t in (("a", tx_a), ("b", tx_b)):
                    tx = make_sender("tcp", src, LAYOUT, shared=KVTransferOptions(tls=t))
                    tid = f"{step}{name}"
                    rx.expect(tid, [1], timeout_s=5)
                    res = await tx.send(tid, rx.endpoint, [2], timeout_s=5)
                    out.append(res.state)
                    await tx.close()
        finally:
            await rx.close()
        return out

    F, D = TransferState.FAILED, TransferState.DONE
    assert run(main(), "asyncio") == [D, F, F, D]


def test_signed_entries_cannot_be_forged_or_replayed(two_cas, tmp_path):
    from services.registry import WorkerInfo
    a, b = two_cas
    worker, _ = identity(a, "decode", tmp_path, "w")
    gateway, _ = identity(a, "gateway", tmp_path, "g")
    other, _ = identity(b, "decode", tmp_path, "o")

    def signed(signer, **kw):
        info = WorkerInfo(worker_id="w1", address="10.0.0.1:1", role="decode", model="m",
                          expires_ms=int(time.time() * 1000) + 5000, cert=signer.cert_pem(),
                          **kw)
        h = info.to_hash()
        h["sig"] = signer.sign(T.entry_payload(h))[1]
        return h

    def check(h):
        gateway.check_entry(h["cert"], T.entry_payload(h), h["sig"], h["role"],
                            int(h["expires_ms"]))

    good = signed(worker)
    check(good)
    for forged, why in (({**good, "address": "6.6.6.6:1"}, "bad signature"),
                        ({**good, "role": "prefill"}, "signed by a decode certificate"),
                        ({**good, "sig": ""}, "unsigned"),
                        (signed(other), "not signed by the cluster CA"),
                        (signed(worker, updated_ms=1) | {"expires_ms": "1"}, "expired")):
        with pytest.raises(T.TlsError, match=why):
            check(forged)


def test_registry_lists_only_signed_entries_and_redis_needs_the_password(two_cas, tmp_path):
    from pdserve.cluster import RedisProcess
    from services.registry import RegistryUnavailable, WorkerInfo, WorkerRegistry
    a, _ = two_cas
    worker, _ = identity(a, "decode", tmp_path, "w")
    gateway, _ = identity(a, "gateway", tmp_path, "g")
    redis = RedisProcess(password="s3cret-pw")
    redis.start()

    async def main():
        writer = WorkerRegistry(redis.url, auth={"password": "s3cret-pw"}, signer=worker)
        reader = WorkerRegistry(redis.url, auth={"password": "s3cret-pw"}, verifier=gateway)
        nobody = WorkerRegistry(redis.url)
        try:
            await writer.register(WorkerInfo("w1", "127.0.0.1:7", "decode", "m"))
            raw = await writer.conn.call(lambda r: r.hgetall("pdserve:worker:w1"))
            forged = {**raw, "worker_id": "w2", "address": "127.0.0.1:8"}
            await writer.conn.call(lambda r: r.hset("pdserve:worker:w2", mapping=forged))
            await writer.conn.call(lambda r: r.sadd("pdserve:workers", "w2"))
            listed = [w.worker_id for w in await reader.list_workers()]
            with pytest.raises(RegistryUnavailable, match="refused our credentials"):
                await nobody.list_workers()
            return listed, dict(reader.refused)
        finally:
            for r in (writer, reader, nobody):
                await r.close()

    try:
        listed, refused = run(main(), "asyncio")
    finally:
        redis.stop()
    assert listed == ["w1"] and refused == {"w2": "bad signature"}


def test_redis_urls_are_shown_without_their_password(caplog):
    from services.redis_client import RedisConn, RedisUnavailable

    async def main():
        conn = RedisConn("redis://:hunter2@127.0.0.1:1/0", timeout_s=0.2)
        try:
            with pytest.raises(RedisUnavailable) as e:
                await conn.call(lambda r: r.ping())
            return str(e.value)
        finally:
            await conn.close()

    with caplog.at_level(logging.WARNING):
        message = run(main(), "asyncio")
    assert "hunter2" not in message and "hunter2" not in caplog.text
    assert "redis://:<redacted>@127.0.0.1:1/0" in message


def test_api_keys_may_be_stored_as_hashes():
    from services.auth import ApiKeyInterceptor, load_api_keys
    stored = load_api_keys([T.api_key_hash("k-live"), "k-plain"])
    check = ApiKeyInterceptor(stored)
    assert check._valid("k-live") and check._valid("k-plain")
    assert not check._valid(T.api_key_hash("k-live")) and not check._valid("k-other")
    with pytest.raises(ValueError, match="64 hex digits"):
        load_api_keys(["sha256:abc"])


def test_without_certificates_a_service_binds_loopback_only(two_cas):
    a, _ = two_cas
    env = {"PDSERVE_DEVICE": "cpu"}
    assert worker_settings([], env=env).host == "127.0.0.1"
    with pytest.raises(ConfigError, match="not a loopback address"):
        worker_settings(["--host", "0.0.0.0"], env=env)
    with pytest.raises(ConfigError, match="not a loopback address"):
        gateway_settings(["--host", "10.1.2.3", "--decode-addrs", "h:1"], env={})
    assert worker_settings(["--insecure"], env=env).host == "0.0.0.0"
    certs = ["--tls-ca-file", a.ca_file, "--tls-cert-file", a.cert("decode"),
             "--tls-key-file", a.key("decode")]
    assert worker_settings(certs, env=env).host == "0.0.0.0"
    with pytest.raises(ConfigError, match="go together"):
        worker_settings(certs[:2], env=env)
    with pytest.raises(ConfigError, match="never taken from the command line"):
        worker_settings(["--redis-password", "x"], env=env)
    s = worker_settings([], env={**env, "PDSERVE_REDIS_PASSWORD": "from-env"})
    assert s.redis_auth() == {"password": "from-env"} and "from-env" not in repr(s)


def test_a_ca_bundle_trusts_old_and_new_during_a_rotation(two_cas, tmp_path):
    a, b = two_cas
    bundle = tmp_path / "both.crt"
    bundle.write_bytes(open(a.ca_file, "rb").read() + open(b.ca_file, "rb").read())
    for files in (a, b):
        t = T.ClusterTls(str(bundle), files.cert("gateway"), files.key("gateway"))
        assert t.role == "gateway"
        worker = T.ClusterTls(files.ca_file, files.cert("decode"), files.key("decode"))
        cert, sig = worker.sign(b"entry")
        t.check_entry(cert, b"entry", sig, "decode", int(time.time() * 1000) + 1000)


# ------------------------------------------- the kvtransfer conformance suite, inside TLS
@pytest.fixture
def kv_tls_by_default(two_cas, monkeypatch):
    """Every KVTransferOptions() made while the test runs carries a cluster identity (a
    colocated certificate: it both sends and receives), so the conformance tests below run
    their tcp transfers over mutual TLS unchanged."""
    a, _ = two_cas
    ident = T.ClusterTls(a.ca_file, a.cert("colocated"), a.key("colocated"))
    defaults = KVTransferOptions.__init__.__defaults__
    monkeypatch.setattr(KVTransferOptions.__init__, "__defaults__", (*defaults[:-1], ident))
    assert KVTransferOptions().tls is ident
    from kvtransfer import secure
    dialled = []
    connect = secure.connect

    async def counted(*args, **kw):
        dialled.append(args[2:4])
        return await connect(*args, **kw)
    monkeypatch.setattr(secure, "connect", counted)
    return dialled


def _conformance():
    import tests.unit.test_kvtransfer as kv
    import tests.unit.test_kvtransfer_faults as kvf
    import tests.unit.test_kvtransfer_pool as pool
    import tests.unit.test_kvtransfer_stream as stream
    import tests.unit.test_kvtransfer_staging as staging
    cases = [(kv.test_round_trip, ("tcp", "uvloop")), (kv.test_round_trip, ("tcp", "asyncio"))]
    for fn in (kv.test_destination_given_after_the_sender_connected,
               kv.test_destination_never_given_times_out_and_cancel_ends_it,
               kv.test_concurrent_transfers, kv.test_layout_mismatch_fails_both_sides,
               kv.test_block_count_mismatch_fails_both_sides,
               kv.test_unknown_and_expired_transfer_ids_are_rejected,
               kv.test_corrupted_data_fails_the_transfer_naming_the_block,
               kvf.test_sender_without_receiver_fails_fast,
               kvf.test_sender_times_out_when_receiver_never_acks, kvf.test_sender_cancel,
               kvf.test_sender_cancel_mid_transfer_fails_receiver, kvf.test_receiver_cancel,
               stream.test_streamed_send_moves_parts_as_they_are_ready,
               stream.test_failed_stream_fails_both_sides,
               staging.test_staged_round_trip_streamed_and_concurrent,  # bulk via pinned
               staging.test_staged_corruption_is_caught_and_cancel_stops_the_copies):
        cases.append((fn, ("tcp",)))
    for fn in (pool.test_sequential_transfers_share_one_connection,
               pool.test_concurrent_transfers_take_their_own_connections_and_keep_them,
               pool.test_a_failed_transfer_closes_its_connection,
               pool.test_a_restarted_receiver_gets_a_new_connection):
        cases.append((fn, ()))
    return cases


@pytest.mark.parametrize("case", _conformance(), ids=lambda c: f"{c[0].__name__}{c[1]}")
def test_kv_conformance_over_tls(kv_tls_by_default, case):
    fn, args = case
    fn(*args)
    assert kv_tls_by_default  # its transfers went through the TLS connect


def test_gateway_client_port_tls_with_an_optional_client_ca(two_cas, tmp_path):
    a, b = two_cas

    async def probe(address, creds):
        ch = (grpc.aio.insecure_channel(address) if creds is None else
              grpc.aio.secure_channel(address, creds,
                                      options=[("grpc.ssl_target_name_override", "localhost")]))
        async with ch:
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=5)
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

    def creds(ca_files, client=None):
        ca = open(ca_files.ca_file, "rb").read()
        if client is None:
            return grpc.ssl_channel_credentials(ca)
        return grpc.ssl_channel_credentials(ca, open(client.key("operator"), "rb").read(),
                                            open(client.cert("operator"), "rb").read())

    async def main(client_ca):
        srv = GrpcServer([], host="127.0.0.1", port=0, credentials=T.client_port_credentials(
            a.cert("gateway"), a.key("gateway"), client_ca))
        await srv.start()
        try:
            return [await probe(srv.address, c) for c in
                    (None, creds(a), creds(b), creds(a, client=b), creds(a, client=a))]
        finally:
            await srv.stop(0)

    # server TLS only: any client that trusts the gateway's CA; plaintext refused
    assert run(main(""), "asyncio") == ["UNAVAILABLE", "OK", "UNAVAILABLE", "OK", "OK"]
    # with a client CA: only clients with a certificate of that CA
    assert run(main(b.ca_file), "asyncio") == ["UNAVAILABLE", "UNAVAILABLE", "UNAVAILABLE",
                                               "OK", "UNAVAILABLE"]


def test_rediss_end_to_end_with_a_real_tls_redis_server(two_cas, tmp_path):
    """A real redis-server (built with TLS) listening for TLS only, with a certificate of the
    cluster CA's redis role and a password: a worker's settings (rediss://, the CA, the
    password file) register signed entries that a gateway's read back; a client that does
    not trust the CA, one of another CA, one without the password and a plaintext one are
    refused."""
    from pdserve.cluster import RedisProcess, RedisTls
    from services.redis_client import RedisConn, RedisUnavailable
    from services.registry import RegistryUnavailable, WorkerInfo, WorkerRegistry
    a, b = two_cas
    pw = tmp_path / "redis-password"
    pw.write_text("tls-pw-123\n")
    redis = RedisProcess(password="tls-pw-123",
                         tls=RedisTls(a.cert("redis"), a.key("redis"), a.ca_file))
    redis.start()
    assert redis.url.startswith("rediss://")

    def settings(*extra):
        return worker_settings(["--redis-url", redis.url, *extra], env={"PDSERVE_DEVICE": "cpu"})
    good = settings("--redis-tls-ca-file", a.ca_file, "--redis-password-file", str(pw))
    assert good.redis_auth() == {"password": "tls-pw-123", "ssl_ca_certs": a.ca_file}
    worker, _ = identity(a, "decode", tmp_path, "w")
    gateway, _ = identity(a, "gateway", tmp_path, "g")

    async def refused(auth, url=redis.url):
        conn = RedisConn(url, timeout_s=2, auth=auth)
        try:
            with pytest.raises(RedisUnavailable) as e:
                await conn.call(lambda r: r.ping())
            return str(e.value)
        finally:
            await conn.close()

    async def main():
        writer = WorkerRegistry(good.redis_url, auth=good.redis_auth(), signer=worker)
        reader = WorkerRegistry(good.redis_url, auth=good.redis_auth(), verifier=gateway)
        try:
            await writer.register(WorkerInfo("w1", "127.0.0.1:7", "decode", "m"))
            listed = [w.worker_id for w in await reader.list_workers()]
        finally:
            await writer.close()
            await reader.close()
        why = [await refused({"password": "tls-pw-123"}),  # the system's CAs only
               await refused({"password": "tls-pw-123", "ssl_ca_certs": b.ca_file}),
               await refused({"ssl_ca_certs": a.ca_file}),  # no password
               await refused({"password": "tls-pw-123"},
                             redis.url.replace("rediss://", "redis://"))]  # plaintext
        return listed, why
    try:
        listed, why = run(main(), "asyncio")
    finally:
        redis.stop()
    assert listed == ["w1"]
    assert "certificate verify failed" in why[0] and "certificate verify failed" in why[1]
    assert "refused our credentials" in why[2], why[2]
    assert "tls-pw-123" not in " ".join(why)
    with pytest.raises(ConfigError, match="needs a rediss://"):
        worker_settings(["--redis-url", "redis://h:1/0", "--redis-tls-ca-file", a.ca_file],
                        env={"PDSERVE_DEVICE": "cpu"})
