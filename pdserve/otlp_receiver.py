"""A tiny in-process OTLP/gRPC trace collector, for tests and benchmarks.

It serves ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on a grpc.aio server
running in its own thread (its own event loop), and keeps every span it receives::

    with OtlpReceiver() as rx:
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint}
        ...                         # run services with env
        spans = rx.wait_for(lambda spans: len(spans) >= 10, timeout_s=10)
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
import threading
import time

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict, hash=False, compare=False)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value",
                                        "double_value") else str(v)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink):
        self.sink = sink

    async def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes}))
        self.sink(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = 0
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _add(self, spans) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.exports += 1

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def start(self) -> "OtlpReceiver":
        ready = threading.Event()

        async def main():
            server = grpc.aio.server()
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self._add),
                                                                      server)
            self.port = server.add_insecure_port(f"{self.host}:0")
            await server.start()
            self._stop = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            ready.set()
            await self._stop.wait()
            await server.stop(0)

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True,
                                        name="otlp-receiver")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("OTLP receiver did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
            self._loop = None

    def wait_for(self, done, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """Poll until ``done(spans)`` is true; returns the spans either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
