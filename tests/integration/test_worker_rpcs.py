"""Workers' own RPCs under malformed requests (workers are internal, but a bad peer must get
a status with a message, never a crash, a hang or a held block)."""
from __future__ import annotations

import asyncio

import grpc

from engine.loader import load_config
from kvtransfer import KVLayout
from pdserve.cluster import LocalCluster
from services.kv_proto import layout_to_proto
from protos.pdserve.v1 import (common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2,
                              worker_pb2_grpc)
from tests.integration.helpers import run, wait_all_free, worker_stats


def test_malformed_prefill_requests_get_a_status_and_leave_nothing_held():
    mc = load_config("dummy:tiny")
    layout = layout_to_proto(KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16,
                                      "float32"))
    sp = common_pb2.SamplingParams(max_tokens=4)
    ids = list(range(3, 40))  # 3 blocks of 16

    def req(rid, prompt=ids, **kv):
        params = dict(transfer_id=f"t-{rid}", backend="tcp", dst_block_ids=[1, 2, 3],
                      receiver_endpoint="tcp://127.0.0.1:9", timeout_ms=2000, layout=layout)
        params.update(kv)
        return worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp,
                                         kv_transfer=common_pb2.KVTransferParams(**params))

    want = {  # request -> (status, words in its message), or a failed transfer in an OK reply
        "no-layout": (req("a", layout=common_pb2.KVLayout()),
                      grpc.StatusCode.INVALID_ARGUMENT, "bad KV layout"),
        "other-layout": (req("b", layout=common_pb2.KVLayout(
            num_layers=3, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")),
            grpc.StatusCode.FAILED_PRECONDITION, "layout"),
        # a decode worker whose blocks would hold one of the two KV heads (TP 2, per-rank
        # caches): refused, never sent whole blocks it would misread
        "part-heads": (req("j", layout=layout_to_proto(
            KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, "float32"), 2, (1, 2))),
            grpc.StatusCode.FAILED_PRECONDITION, "takes heads [1, 2), this worker sends [0, 2)"),
        "backend": (req("c", backend="pigeon"), grpc.StatusCode.FAILED_PRECONDITION, "pigeon"),
        "blocks": (req("d", dst_block_ids=[1, 2, 3, 4]), grpc.StatusCode.INVALID_ARGUMENT,
                   "expects 4 blocks"),
        "vocab": (req("e", prompt=[10**6] * 33), grpc.StatusCode.INVALID_ARGUMENT,
                  "vocabulary"),
        "endpoint": (req("f", receiver_endpoint="garbage"), None, "not a tcp:// endpoint"),
        "refused": (req("g"), None, "ConnectionRefused"),
        "count-only": (req("h", dst_block_ids=[], num_blocks=3), None, "ConnectionRefused"),
        "count-disagrees": (req("i", num_blocks=2), grpc.StatusCode.INVALID_ARGUMENT,
                            "num_blocks is 2 but 3 dst_block_ids"),
    }

    async def probe(address):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.PrefillWorkerStub(ch)

            async def one(r):
                try:
                    resp = await stub.Prefill(r, timeout=30)
                    return None, resp.transfer.state, resp.transfer.error
                except grpc.aio.AioRpcError as e:
                    return e.code(), None, e.details()
            return await asyncio.gather(*(one(r) for r, _, _ in want.values()))

    async def decode_with_long_id(address, prefill_address):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            r = worker_pb2.DecodeRequest(request_id="r" * 5000, prompt_token_ids=ids,
                                         sampling=sp, prefill_address=prefill_address)
            try:
                async for _ in stub.Generate(r, timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

    with LocalCluster("dummy:tiny", prefill=1, decode=1, secure=False) as c:
        pre = next(w for w in c.workers if w.kind == "prefill")
        dec = next(w for w in c.workers if w.kind == "decode")
        # (it used to pre-allocate, then fail on the transfer id, keeping the blocks)
        assert run(decode_with_long_id(dec.address, pre.address)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "request_id is longer than 256 bytes")
        for (name, (_, code, words)), (got, state, msg) in zip(want.items(), run(probe(pre.address))):
            assert got == code, (name, got, msg)
            assert words in msg, (name, msg)
            if code is None:
                assert state == common_pb2.TRANSFER_STATE_FAILED, (name, state)
        for stats in run(wait_all_free([pre.address, dec.address], timeout_s=15)):
            assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting,
                    stats.active_transfers) == (0, 0, 0, 0)
        assert pre.proc.poll() is None and dec.proc.poll() is None


def test_decode_worker_without_room_refuses_and_calls_off_the_prefill():
    """The decode worker asks for the prefill while it reserves the blocks: when the
    reservation fails, the caller gets RESOURCE_EXHAUSTED and the prefill already started
    is called off (its compute and transfer end, nothing stays held on either side); a
    request that fits still works afterwards. kv_blocks_wait_s 0: refused at once, not
    after waiting for the holder to free its blocks (that wait, and its timeout, are
    tests/integration/test_kv_pressure.py and tests/unit/test_async_engine.py; the refusal
    after it takes this same path)."""
    sp_long = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    sp = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    prompt = list(range(3, 3 + 16 * 5))  # 5 blocks of a 8-block cache

    async def main(dec, pre):
        async with grpc.aio.insecure_channel(dec.address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)

            def call(rid, sampling):
                return stub.Generate(worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                    prefill_address=pre.address), timeout=60)
            holder = call("holder", sp_long)
            await holder.read()  # first token: the holder's 5+ blocks are in use
            try:
                async for _ in call("squeezed", sp):
                    pass
                refused = None
            except grpc.aio.AioRpcError as e:
                refused = (e.code(), e.details())
            # the same through the gateway, whose only decode worker refuses: the client
            # hears that worker's status, not "no workers available"
            async with grpc.aio.insecure_channel(gw_address) as gch:
                gstub = gateway_pb2_grpc.GatewayStub(gch)
                try:
                    async for _ in gstub.Generate(gateway_pb2.GenerateRequest(
                            prompt_token_ids=prompt, sampling=sp), timeout=60):
                        pass
                    via_gateway = None
                except grpc.aio.AioRpcError as e:
                    via_gateway = (e.code(), e.details())
            holder.cancel()
            await wait_all_free([dec.address], timeout_s=15)  # the holder's blocks come back
            ok = [r async for r in call("after", sp)]
            return refused, via_gateway, ok

    with LocalCluster("dummy:tiny", prefill=1, decode=1, secure=False,
                      worker_args=("--num-blocks", "8", "--kv-blocks-wait-s", "0")) as c:
        pre = next(w for w in c.workers if w.kind == "prefill")
        dec = next(w for w in c.workers if w.kind == "decode")
        gw_address = c.address
        refused, via_gateway, ok = run(main(dec, pre))
        assert refused == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "decode worker has no free KV blocks for this prompt")
        assert via_gateway == refused
        assert ok and ok[-1].finish_reason in ("stop", "length")
        for stats in run(wait_all_free([pre.address, dec.address], timeout_s=15)):
            assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting,
                    stats.active_transfers) == (0, 0, 0, 0)
        assert pre.proc.poll() is None and dec.proc.poll() is None


def test_prefill_answers_once_the_receiver_accepted_and_one_label_twice_is_two_requests():
    """The Prefill answer goes out with the first token once the receiver has accepted the
    transfer (TRANSFERRING), not after the last byte; the blocks stay leased until the send
    ends. A second Prefill with the same request_id (a label, not an identity) is a request
    of its own: it is served while the first one's send is still pending, and each lease
    ends with its own send."""
    import torch

    from kvtransfer import make_receiver, TransferState

    mc = load_config("dummy:tiny")
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, "float32")
    sp = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    ids = list(range(3, 3 + 40))  # 3 blocks

    async def main(address):
        cache = torch.zeros(8, *layout.block_shape)
        rx = make_receiver("tcp", cache, layout)
        await rx.start()

        def req(tid):
            return worker_pb2.PrefillRequest(
                request_id="same", prompt_token_ids=ids, sampling=sp,
                kv_transfer=common_pb2.KVTransferParams(
                    transfer_id=tid, backend="tcp", receiver_endpoint=rx.endpoint,
                    num_blocks=3, timeout_ms=20000, layout=layout_to_proto(layout)))
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = worker_pb2_grpc.PrefillWorkerStub(ch)
                first = rx.expect("t1", 3, timeout_s=20)  # ids withheld: the data waits
                resp = await stub.Prefill(req("t1"), timeout=20)
                assert resp.transfer.state == common_pb2.TRANSFER_STATE_TRANSFERRING
                assert resp.transfer.num_blocks == 3 and first.state is TransferState.TRANSFERRING
                held = (await worker_stats(address)).kv_blocks_used
                second = rx.expect("t2", 3, timeout_s=20)
                resp2 = await stub.Prefill(req("t2"), timeout=20)  # not blocked by t1
                assert resp2.first_token_id == resp.first_token_id
                assert resp2.transfer.state == common_pb2.TRANSFER_STATE_TRANSFERRING
                both = (await worker_stats(address)).kv_blocks_used
                second.assign([3, 4, 5])
                assert (await second.wait()).state is TransferState.DONE
                first.assign([0, 1, 2])
                assert (await first.wait()).state is TransferState.DONE
                assert torch.equal(cache[[0, 1, 2]], cache[[3, 4, 5]]) and cache[0].any()
                return held, both
        finally:
            await rx.close()

    with LocalCluster("dummy:tiny", prefill=1, decode=0, secure=False) as c:
        pre = next(w for w in c.workers if w.kind == "prefill")
        held, both = run(main(pre.address))
        assert held >= 3  # leased while its transfer ran
        assert both > held  # the second request holds blocks of its own (its tail)
        for stats in run(wait_all_free([pre.address], timeout_s=15)):
            assert (stats.kv_blocks_used, stats.num_running, stats.active_transfers) == (0, 0, 0)


class _ScriptedPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """A prefill worker played by the test: it answers at once with a chosen first token
    (TRANSFERRING), then moves the KV over a real tcp sender as the request id says: 'late'
    sends it after LATE_S, 'broken' sends one block short (the transfer FAILS on both
    sides)."""

    FIRST, TEXT, LATE_S = 7, "<first>", 1.5

    def __init__(self, layout):
        import torch

        from kvtransfer import make_sender
        self.layout = layout
        self.tx = make_sender("tcp", torch.zeros(16, *layout.block_shape), layout)
        self.tasks = set()
        self.sending_at: dict[str, float] = {}  # request id -> time.monotonic() its KV left

    async def Prefill(self, request, context):
        kv = request.kv_transfer
        ids = list(range(kv.num_blocks))
        if request.request_id.startswith("broken"):
            ids = ids[:-1]
        delay = self.LATE_S if request.request_id.startswith("late") else 0.05
        task = asyncio.get_running_loop().create_task(
            self._send(request.request_id, kv, ids, delay))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return worker_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=self.FIRST, first_text=self.TEXT,
            transfer=common_pb2.KVTransferResult(
                state=common_pb2.TRANSFER_STATE_TRANSFERRING, num_blocks=kv.num_blocks))

    async def _send(self, rid, kv, ids, delay):
        import time

        await asyncio.sleep(delay)
        self.sending_at[rid] = time.monotonic()
        await self.tx.send(kv.transfer_id, kv.receiver_endpoint, ids, 10)


def test_first_token_streams_before_the_kv_and_a_failed_transfer_continues_from_it():
    """The decode worker streams the prefill worker's first token (with its text) as soon as
    the Prefill answer is in, not once the KV landed: with the KV held back 1.5 s, the first
    token arrives long before the second. When the transfer then fails, the decode worker
    prefills locally and continues from the token already streamed (never sends another
    first token): the tokens after it are exactly what the same worker generates, greedy,
    for the prompt plus that token. Nothing stays held."""
    from pdserve.cluster import free_port
    import time

    mc = load_config("dummy:tiny")
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, "float32")
    prompt = list(range(3, 3 + 40))  # 3 blocks
    sp = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main(dec):
        peer = _ScriptedPrefill(layout)
        server = grpc.aio.server()
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(peer, server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(dec.address) as ch:
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)

                async def generate(rid, ids=prompt, sampling=sp, prefill=f"127.0.0.1:{port}"):
                    t0, got = time.monotonic(), []
                    async for r in stub.Generate(worker_pb2.DecodeRequest(
                            request_id=rid, prompt_token_ids=ids, sampling=sampling,
                            prefill_address=prefill), timeout=60):
                        now = time.monotonic()
                        got.append((now - t0, list(r.token_ids), r.text,
                                    r.finish_reason, r.usage.completion_tokens, now))
                    return got
                late = await generate("late-1")
                broken = await generate("broken-1")
                sp5 = common_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
                local = await generate("local-1", prompt + [_ScriptedPrefill.FIRST], sp5, "")
        finally:
            await server.stop(1)
            await peer.tx.close()
        return late, broken, [t for r in local for t in r[1]], peer.sending_at["late-1"]

    with LocalCluster("dummy:tiny", prefill=0, decode=1, kv_backend="tcp", secure=False) as c:
        dec = next(w for w in c.workers if w.kind == "decode")
        late, broken, want, kv_sent_at = run(main(dec))
        # late: the first token (and its text) long before the KV, then the rest after it
        assert late[0][1:3] == ([_ScriptedPrefill.FIRST], _ScriptedPrefill.TEXT), late[0]
        # (before the KV started to move, whatever the machine's speed)
        assert late[0][5] < kv_sent_at and late[1][0] >= _ScriptedPrefill.LATE_S - 0.05, \
            (late[:2], kv_sent_at)
        assert sum(len(r[1]) for r in late) == 6 and late[-1][3] == "length"
        assert late[-1][4] == 6  # usage counts the early token once
        # broken: the token already streamed, then the local continuation from it
        tokens = [t for r in broken for t in r[1]]
        assert tokens == [_ScriptedPrefill.FIRST] + want, (tokens, want)
        assert broken[-1][3] == "length" and broken[-1][4] == 6
        for stats in run(wait_all_free([dec.address], timeout_s=15)):
            assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
