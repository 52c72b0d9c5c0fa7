"""OpenTelemetry tracing for every service: setup from the standard OTEL_* variables, W3C trace
context in gRPC metadata, and spans that cost nothing when tracing is off.

Switching it on (per process; the usual OpenTelemetry variables)::

    OTEL_TRACES_EXPORTER=otlp              # "none" (or unset without an endpoint): off
    OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4317     # OTLP/gRPC; setting it alone turns it on
    OTEL_SERVICE_NAME=pdserve-gateway      # default: pdserve-<service>
    OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.1
    OTEL_BSP_SCHEDULE_DELAY=500            # batch export delay (ms)
    OTEL_SDK_DISABLED=true                 # off, whatever else is set

When off, every helper returns :data:`NOOP_SPAN` (one shared object; no span, no context is
built) after checking one module flag, and the trace id still reaches the logs when the caller
sent a ``traceparent``.

Spans and their parents (one trace per request, across processes)::

    gateway.Generate (gateway)                       <- extracted from the client's traceparent
      route
      decode.generate (decode worker)                <- traceparent injected by the gateway
        prefill.remote
          prefill (prefill worker)                   <- traceparent injected by the decode worker
            queue  prefill.compute  kv.transfer
        kv.receive
        decode

Spans are parented explicitly (``child(parent, name)``) rather than through the ambient context,
because servicers are async generators whose frames may be resumed or closed outside the task
that started them.
"""
from __future__ import annotations

import logging
import re
import time

from pdcore.config_tree import standard_environ

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
ENABLED = False  # the one flag the hot path checks
_tracer = None
_provider = None
_propagator = None
_in_context = None  # opentelemetry.trace.set_span_in_context, bound at setup
_SERVER = None  # SpanKind.SERVER


class _NoopSpan:
    """Stands in for a span when tracing is off: every method does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set_attribute(self, key, value) -> None:
        pass

    def set_attributes(self, attributes) -> None:
        pass

    def set_status(self, *args, **kw) -> None:
        pass

    def record_exception(self, *args, **kw) -> None:
        pass

    def add_event(self, *args, **kw) -> None:
        pass

    def end(self, end_time=None) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NOOP_SPAN = _NoopSpan()


def tracing_requested(env=None) -> bool:
    """Whether the OTEL_* variables ask for trace export (``otlp``)."""
    env = standard_environ() if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")
                 if e.strip()]
    if exporters:
        if exporters == ["none"]:
            return False
        unknown = set(exporters) - {"otlp", "none"}
        if unknown:
            logger.warning("OTEL_TRACES_EXPORTER %s not supported (only otlp); ignored",
                           sorted(unknown))
        return "otlp" in exporters
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup_tracing(service: str, env=None) -> bool:
    """Configure the tracer of this process from OTEL_*; returns whether tracing is on."""
    global ENABLED, _tracer, _provider, _propagator, _in_context, _SERVER
    if not tracing_requested(env):
        ENABLED = False
        return False
    env = standard_environ() if env is None else env
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    name = env.get("OTEL_SERVICE_NAME") or f"pdserve-{service}"
    # Resource.create also reads OTEL_RESOURCE_ATTRIBUTES; the sampler comes from OTEL_TRACES_*
    _provider = TracerProvider(resource=Resource.create({"service.name": name}))
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
    _tracer = _provider.get_tracer("pdserve")
    _propagator = TraceContextTextMapPropagator()
    _in_context, _SERVER = trace.set_span_in_context, trace.SpanKind.SERVER
    ENABLED = True
    logger.info("tracing on: service %s -> %s", name, endpoint or "default OTLP endpoint")
    return True


def shutdown_tracing() -> None:
    """Flush pending spans and stop the exporter (end of the process)."""
    global ENABLED, _provider
    ENABLED = False
    if _provider is not None:
        try:
            _provider.shutdown()
        except Exception:  # noqa: BLE001 - collector gone: nothing to do at exit
            logger.warning("flushing traces failed", exc_info=True)
        _provider = None


# ------------------------------------------------------------- propagation
# W3C Trace Context: traceparent is version-traceid-parentid-flags in lowercase hex; a
# tracestate is at most 32 list members of printable ASCII (512 bytes is the size a vendor
# may rely on). Anything else a client sends is dropped here, never passed on: a header
# that is not valid gRPC metadata would fail the call it rides on.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{0,512}")


def _valid_trace_header(key: str, value) -> bool:
    if not isinstance(value, str):
        return False
    if key == "traceparent":
        return _TRACEPARENT.fullmatch(value) is not None
    return _TRACESTATE.fullmatch(value) is not None


def incoming_headers(grpc_context) -> dict[str, str]:
    """The caller's W3C trace headers that are well-formed (others are dropped)."""
    return {k: v for k, v in (grpc_context.invocation_metadata() or ())
            if k in TRACE_HEADERS and _valid_trace_header(k, v)}


def server_span(name: str, grpc_context, attributes: dict | None = None):
    """A SERVER span whose parent is the caller's ``traceparent`` (a root span if none)."""
    if not ENABLED:
        return NOOP_SPAN
    parent = _propagator.extract(incoming_headers(grpc_context))
    return _tracer.start_span(name, context=parent, kind=_SERVER, attributes=attributes)


def child(parent, name: str, attributes: dict | None = None, start_time: int | None = None):
    """A span under ``parent`` (a span from this module); NOOP_SPAN when tracing is off."""
    if not ENABLED or not parent.is_recording():
        return NOOP_SPAN
    return _tracer.start_span(name, context=_in_context(parent),
                              attributes=attributes, start_time=start_time)


def outgoing_metadata(span, grpc_context=None) -> tuple[tuple[str, str], ...]:
    """Metadata for a call made on behalf of ``span``: its W3C context when tracing is on;
    otherwise the trace headers this process received (so a trace survives a hop with tracing
    off)."""
    if ENABLED and span.is_recording():
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=_in_context(span))
        return tuple(carrier.items())
    if grpc_context is None:
        return ()
    return tuple(incoming_headers(grpc_context).items())


def trace_id(span, grpc_context=None) -> str:
    """Hex trace id for logs: the span's, or the one in the caller's traceparent, or ''."""
    if ENABLED and span.is_recording():
        return format(span.get_span_context().trace_id, "032x")
    if grpc_context is not None:
        parent = incoming_headers(grpc_context).get("traceparent")
        return parent.split("-")[1] if parent else ""
    return ""


def end_with_status(span, code_name: str, message: str = "") -> None:
    """Mark ``span`` failed with a gRPC status name (``OK`` leaves it unset) and end it."""
    if span is NOOP_SPAN:
        return
    if code_name != "OK":
        from opentelemetry.trace import Status, StatusCode
        span.set_attribute("rpc.grpc.status_code", code_name)
        span.set_status(Status(StatusCode.ERROR, f"{code_name}: {message}"[:200]))
    span.end()


class StepClock:
    """When the first engine step that scheduled a request began, and when the step that
    produced its output ended (wall clock ns), for splitting a prefill into ``queue`` and
    ``prefill.compute`` spans (a chunked prefill's compute covers all its chunks). Registered
    as an ``AsyncEngine.step_listener`` only while tracing is on; ``watch`` before
    submitting."""

    def __init__(self, aengine):
        self.aengine = aengine
        self._times: dict[str, list[int | None]] = {}  # rid -> [first step start, end]
        aengine.step_listeners.append(self._on_step)

    def _on_step(self, outs) -> None:  # engine thread
        times = self._times
        if not times:
            return
        now = time.time_ns()
        started = self.aengine.step_started_ns
        sched = getattr(self.aengine.engine, "last_schedule", None)
        for item in sched.scheduled if sched is not None else ():
            t = times.get(item.seq.request_id)
            if t is not None and t[0] is None:
                t[0] = started
        for out in outs:
            t = times.get(out.request_id)
            if t is not None and t[1] is None:
                t[1] = now
                if t[0] is None:
                    t[0] = started

    def watch(self, rid: str) -> None:
        self._times[rid] = [None, None]

    def pop(self, rid: str) -> tuple[int, int] | None:
        t = self._times.pop(rid, None)
        return (t[0], t[1]) if t is not None and t[1] is not None else None
