"""The settings of every entry point, one tree each, and their builders.

    engine     engine.config.EngineConfig: LLM(model, **kw) and the engine of every worker
    worker     WorkerSettings: pdserve prefill | decode | colocated (its engine is a section)
    gateway    GatewaySettings: pdserve gateway
    client     ClientSettings: pdserve generate | chat | bench

Each tree is frozen dataclasses that only validate; pdcore/config_tree.py fills them:
defaults < config file (``--config FILE``, ``PDSERVE_CONFIG``) < ``PDSERVE_*`` variables <
flags (< keywords, for ``LLM``). The field ``some_name`` is the flag ``--some-name``, the
variable ``PDSERVE_SOME_NAME``, the file key and the keyword ``some_name``. Bad values raise
:class:`ConfigError` naming the setting and where it was set; unknown names in a file or in
``PDSERVE_*`` are errors naming the nearest setting. docs/configuration.md is generated from
these trees (``pdserve config docs``); ``pdserve config show`` prints one resolved.

    gateway_settings(argv=None, env=None) -> GatewaySettings
    worker_settings(argv=None, env=None, role="colocated") -> WorkerSettings (device resolved)
    engine_config(model, env=None, **kw) -> EngineConfig          (what LLM uses)
    client_settings(env=None) -> ClientSettings
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
import socket
from typing import Any

from pdcore.hostport import bare_host, host_problem, join_host_port, split_host_port
from engine.config import (EngineConfig, SettingError, check_settings, resolve_engine_config,
                           section, setting)
from pdcore.config_tree import ConfigError, build, tree  # noqa: F401 - re-exported
from pdcore.settings import HOST, ID_TEXT, LABEL, NAME
from services.redis_url import redis_url_problem  # noqa: F401 - re-exported
from services.validation import RequestLimits

ROLES = ("prefill", "decode", "colocated")
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")

# kv_backend=auto: a colocated worker moves no KV; a GPU worker prefers the copy engines on
# one host (cuda_ipc also serves a prefill and a decode worker sharing one GPU, where NCCL
# cannot), then NCCL between hosts (tcp also moves a GPU cache, through pinned host memory,
# for hosts without NVLink or RDMA: name it explicitly); a CPU worker uses tcp. Which
# backends exist and which devices each serves: the kvtransfer registry, the one list
# (backend_devices).
DEFAULT_KV_BACKENDS = {"cpu": "tcp", "cuda": "cuda_ipc,nccl"}


def backend_devices() -> dict[str, tuple[str, ...]]:
    """Each KV backend and the cache devices it moves, from the kvtransfer registry (workers
    only ask: it imports torch)."""
    from kvtransfer import registry
    return {name: registry.spec(name).devices for name in registry.backends()}


def default_kv_backend(role: str, device_kind: str) -> str:
    return "none" if role == "colocated" else DEFAULT_KV_BACKENDS[device_kind]


def _check_address(a: str) -> None:
    """host:port, an IPv6 host in brackets ([::1]:50051); ValueError saying what is wrong."""
    split_host_port(a)


def _check_peer(a: str) -> None:
    """A peer_addrs entry: host:port, or a KV endpoint scheme://host:port (scheme://name
    for a backend that listens on no TCP port, e.g. shm://)."""
    scheme, sep, rest = a.partition("://")
    if not sep:
        split_host_port(a)
    elif not scheme or not rest:
        raise ValueError(f"expected host:port or scheme://host:port, got {a!r}")
    elif ":" in rest:
        try:
            split_host_port(rest)
        except ValueError as e:
            raise ValueError(f"{e} (in {a!r})") from None


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _port(default: int, help: str) -> Any:
    return setting(default, help, ge=0, le=65535)


def _switch_interval() -> Any:
    return setting(100.0, "microseconds a thread may keep Python's interpreter lock while "
                          "another waits for it (sys.setswitchinterval; Python's default: "
                          "5000): short hands gRPC's completion thread and a worker's engine "
                          "thread the lock sooner (docs/performance.md)", gt=0.0, le=1e6)


@dataclass(frozen=True)
class ServiceSettings:
    """What every service has: its gRPC server, Redis, shutdown, metrics and logs."""

    host: str = setting("", "address to bind (default: every interface, 0.0.0.0, with "
                            "certificates or --insecure; else 127.0.0.1: without "
                            "certificates a service binds loopback only unless --insecure)")
    port: int = _port(50051, "gRPC port (0: any free port)")
    redis_url: str = setting("", "Redis for the worker registry and the prefix index "
                                 "(redis://, rediss:// or unix://; a password in it is never "
                                 "shown); empty: none")
    redis_username: str = setting("", "Redis ACL user (empty: the default user)")
    redis_password: str = setting("", "Redis password: from PDSERVE_REDIS_PASSWORD or the "
                                      "config file only (refused as a flag: flags show in "
                                      "ps); prefer redis_password_file", secret=True)
    redis_password_file: str = setting("", "file holding the Redis password (a mounted "
                                           "Secret)")
    redis_tls_ca_file: str = setting("", "rediss://: CA that signed the Redis server's "
                                         "certificate (default: the system's CAs)")
    namespace: str = setting("pdserve", "Redis key prefix", pattern=NAME)
    redis_timeout_s: float = setting(0.25, "Redis connect/read timeout", gt=0.0)
    grace_s: float = setting(10.0, "shutdown: time in-flight requests get to finish", ge=0.0)
    drain_delay_s: float = setting(0.5, "shutdown: NOT_SERVING this long before refusing RPCs",
                                   ge=0.0)
    max_message_bytes: int = setting(64 * 1024 * 1024, "gRPC max message size", ge=1024,
                                     le=2**31 - 1, unit="bytes")
    metrics_port: int = _port(0, "Prometheus /metrics port (0: off)")
    metrics_tls_cert_file: str = setting("", "TLS on the /metrics port: its certificate (PEM; "
                                             "read at start); empty: plaintext")
    metrics_tls_key_file: str = setting("", "TLS on the /metrics port: its private key (PEM)")
    metrics_tls_ca_file: str = setting("", "TLS on the /metrics port: also require a client "
                                           "certificate signed by this CA (the scraper's)")
    gil_switch_interval_us: float = _switch_interval()
    log_level: str = setting("INFO", "log level", choices=LOG_LEVELS)
    log_format: str = setting("json", "log lines: json or text", choices=LOG_FORMATS)
    tls_ca_file: str = setting("", "mutual TLS between services: the cluster CA certificate "
                                   "(PEM); with tls_cert_file and tls_key_file (reloaded when "
                                   "they change; docs/security.md)")
    tls_cert_file: str = setting("", "this service's certificate (PEM, signed by the cluster "
                                     "CA, carrying its role)")
    tls_key_file: str = setting("", "this service's private key (PEM)")
    insecure: bool = setting(False, "no TLS between services, no role or membership checks, "
                                    "unsigned registry entries, any bind address: trust the "
                                    "network (an explicit choice, logged as a warning)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_level", str(self.log_level).upper())
        check_settings(self)
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://",
                                                              "unix://")):
            raise SettingError("redis_url", "redis_url must start with redis://, rediss:// or "
                                            "unix://")
        problem = redis_url_problem(self.redis_url) if self.redis_url else None
        if problem:
            raise SettingError("redis_url", f"redis_url: {problem}")
        self._check_security()

    @property
    def tls(self) -> bool:
        """Whether this service has its cluster certificate (mutual TLS)."""
        return bool(self.tls_cert_file)

    def _check_security(self) -> None:
        given = [bool(getattr(self, n)) for n in ("tls_ca_file", "tls_cert_file",
                                                   "tls_key_file")]
        if any(given) and not all(given):
            raise SettingError("tls_cert_file", "tls_ca_file, tls_cert_file and tls_key_file "
                                                "go together")
        if self.tls and self.insecure:
            raise SettingError("insecure", "insecure and tls_cert_file exclude each other")
        if not self.host:
            object.__setattr__(self, "host", "0.0.0.0" if self.tls or self.insecure
                               else "127.0.0.1")
        if not (self.tls or self.insecure or is_loopback(self.host)):
            raise SettingError("host", (
                f"host {self.host!r} is not a loopback address: without certificates "
                f"(tls_ca_file, tls_cert_file, tls_key_file) a service binds loopback "
                f"only; give certificates, or --insecure to serve plaintext there"))
        if bool(self.metrics_tls_cert_file) != bool(self.metrics_tls_key_file):
            raise SettingError("metrics_tls_cert_file", "metrics_tls_cert_file and "
                                                        "metrics_tls_key_file go together")
        if self.metrics_tls_ca_file and not self.metrics_tls_cert_file:
            raise SettingError("metrics_tls_ca_file", "metrics_tls_ca_file needs "
                                                      "metrics_tls_cert_file")
        if self.redis_tls_ca_file and not self.redis_url.startswith("rediss://"):
            raise SettingError("redis_tls_ca_file", "redis_tls_ca_file needs a rediss:// "
                                                    "redis_url")
        if self.redis_password and self.redis_password_file:
            raise SettingError("redis_password", "redis_password and redis_password_file "
                                                 "exclude each other")

    def redis_auth(self) -> dict[str, str]:
        """Redis client keywords: the user and password (read from its file now) and the
        rediss:// CA; {} when none is set."""
        from services.tls import read_secret_file
        kw = {}
        password = self.redis_password
        if self.redis_password_file:
            password = read_secret_file(self.redis_password_file, "redis_password_file")
        if password:
            kw["password"] = password
        if self.redis_username:
            kw["username"] = self.redis_username
        if self.redis_tls_ca_file:
            kw["ssl_ca_certs"] = self.redis_tls_ca_file
        return kw

    def __repr__(self) -> str:  # secrets and URL passwords redacted
        from pdcore.config_tree import flat, redact
        specs = tree(type(self))
        body = ", ".join(f"{k}={redact(specs[k], v)!r}" for k, v in flat(self).items())
        return f"{type(self).__name__}({body})"


@dataclass(frozen=True, repr=False)
class GatewaySettings(ServiceSettings):
    """The gateway: front door, router, client authentication."""

    model: str = setting("smollm2-135m", "model spec (its tokenizer and context length); "
                                         "requests naming another model are refused")
    prefill_addrs: tuple[str, ...] = setting((), "static prefill workers host:port,...")
    decode_addrs: tuple[str, ...] = setting((), "static decode / colocated workers "
                                                "host:port,...")
    static_capacity: int = setting(
        64, "requests each static worker (--decode-addrs / --prefill-addrs) is assumed to "
            "hold at once; registered workers report their own (max_num_seqs)", ge=1)
    queue_factor: float = setting(
        2.0, "shedding: a request is refused RESOURCE_EXHAUSTED when the decode pool already "
             "has queue_factor x its summed capacity in flight", gt=0.0, le=1000.0)
    block_size: int = setting(16, "KV block size in tokens (must match the workers)", ge=1,
                              le=1024)
    hash_seed: str = setting("pdserve-v1", "block-hash seed (must match the workers)",
                             pattern=LABEL)
    prefix_weight: float = setting(1.0, "router: weight of cached prefix vs load", ge=0.0,
                                   le=1000.0)
    local_prefill_max_tokens: int = setting(
        0, "router: a prompt with at most this many tokens uncached on the chosen decode "
           "worker is prefilled there, not on a prefill worker, while that prefill worker is "
           "backed up (see local_prefill_queue_tokens); 0: off", ge=0)
    local_prefill_queue_tokens: int = setting(
        8192, "router: a prefill worker counts as backed up when at least this many uncached "
              "prompt tokens this gateway sent it await their first token (0: always, i.e. "
              "every short prompt prefills locally)", ge=0)
    local_prefill_decode_tokens: int = setting(
        0, "router: local prefill only while the decode worker's own such prompts awaiting "
           "their first token stay within this many uncached tokens (a decode worker that "
           "falls behind gets no more); 0: no cap", ge=0)
    refresh_s: float = setting(1.0, "how often to re-read the registry", gt=0.0)
    registry_grace_s: float = setting(
        3.0, "after Redis was unreachable, or when a listing holds none of the workers known "
             "(Redis restarted empty), workers missing from it that still answer their probes "
             "keep serving this long while they re-register", ge=0.0)
    reaper_interval_s: float = setting(1.0, "how often to reap dead workers' index entries",
                                       gt=0.0)
    request_timeout_s: float = setting(600.0, "end-to-end deadline per request", gt=0.0)
    api_keys: tuple[str, ...] = setting(
        (), "accepted client API keys (prefer PDSERVE_API_KEYS or api_key_file: flags show in "
            "ps); none: no auth", secret=True)
    api_key_file: str = setting("", "file with one accepted client API key per line (a "
                                    "line may hold a key's hash instead: sha256:<hex>, "
                                    "pdserve hash-key)")
    client_tls_cert_file: str = setting("", "TLS on the client port: the gateway's "
                                            "certificate (PEM); empty: plaintext")
    client_tls_key_file: str = setting("", "TLS on the client port: its private key (PEM)")
    client_tls_ca_file: str = setting("", "TLS on the client port: also require a client "
                                          "certificate signed by this CA (beside API keys)")
    max_message_bytes: int = setting(
        4 * 1024 * 1024, "largest gRPC message a client may send (bigger: RESOURCE_EXHAUSTED "
                         "before it is parsed); above max_prompt_bytes", ge=1024, le=2**31 - 1,
        unit="bytes")
    decode_stream: str = setting(
        "many", "how requests travel to a decode worker: many (all of them on one "
                "GenerateMany stream per worker, one message per engine step) or per_request "
                "(one Generate call each; workers without GenerateMany get these anyway)",
        choices=("many", "per_request"))
    max_migrations: int = setting(3, "times a request may move to another decode worker after "
                                     "the one streaming it failed (0: never)", ge=0)
    health_interval_s: float = setting(1.0, "how often each worker is probed (Stats, which "
                                            "also gives a static worker's capacity and load)",
                                       gt=0.0)
    health_timeout_s: float = setting(1.0, "a probe unanswered this long fails", gt=0.0)
    health_failures: int = setting(2, "consecutive failed probes after which a worker gets no "
                                      "new requests and its streams move elsewhere", ge=1)
    tokenizer_threads: int = setting(2, "threads that tokenize prompts (off the event loop)",
                                     ge=1)
    tokenizer_queue: int = setting(256, "prompts waiting for a tokenizer thread beyond which "
                                        "requests get RESOURCE_EXHAUSTED", ge=1)
    malloc_arenas: int = setting(
        2, "glibc malloc arenas of the gateway process (0: glibc's default, 8 per core): few "
           "arenas keep the threads that tokenize megabyte prompts from fragmenting the heap, "
           "which otherwise grows with every such prompt", ge=0)
    key_max_concurrent: int = setting(0, "requests one API key may have in flight (0: no "
                                         "limit but key_max_seat_share)", ge=0)
    key_max_seat_share: float = setting(0.5, "with two or more API keys, the share of the "
                                             "decode pool's capacity one key may hold (1: no "
                                             "limit)", gt=0.0, le=1.0)
    key_max_tokens_per_s: float = setting(0.0, "prompt + completion tokens per second one API "
                                               "key may use, averaged over 10 s (0: no limit)",
                                          ge=0.0, le=1e9)  # a rate, not a duration
    http_port: int = _port(8000, "OpenAI-compatible HTTP API port, bound on host like the "
                                 "gRPC port (0: off)")
    served_model_name: str = setting("", "model name the HTTP API lists and accepts besides "
                                         "the model's own id (empty: the model's id only)",
                                     pattern=LABEL)
    http_max_body_bytes: int = setting(
        8 * 1024 * 1024, "largest HTTP request body (bigger: 413 before it is parsed; JSON "
                         "escapes make it larger than the gRPC message)", ge=1024,
        unit="bytes")
    http_body_timeout_s: float = setting(
        30.0, "an HTTP request body not received in full within this many seconds is "
              "answered 408 and its connection closed (a client that stalls mid-body holds "
              "no connection for long)", gt=0.0)
    http_max_header_bytes: int = setting(
        64 * 1024, "largest HTTP request line + headers (bigger: 431 and the connection "
                   "closed, before the rest is read)", ge=1024, unit="bytes")
    http_header_timeout_s: float = setting(
        10.0, "an HTTP connection whose request line and headers are not complete this many "
              "seconds after it opened or its request began is answered 408 and closed (idle "
              "and slowloris connections hold nothing for long)", gt=0.0)
    http_max_connections: int = setting(
        8192, "open HTTP connections beyond which a new one is answered 503 and closed (the "
              "gateway raises its open-file limit to fit them where the hard limit allows)",
        ge=1)
    limits: RequestLimits = section(RequestLimits, "request limits")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size & (self.block_size - 1):
            raise SettingError("block_size", f"block_size must be a power of two, "
                                             f"got {self.block_size}")
        if not self.model:
            raise SettingError("model", "model must not be empty")
        if not self.redis_url and not self.decode_addrs:
            raise ValueError("need redis_url or decode_addrs (where do workers come from?)")
        for name in ("prefill_addrs", "decode_addrs"):
            seen = set()
            for a in getattr(self, name):
                try:
                    _check_address(a)
                except ValueError as e:
                    raise SettingError(name, f"{name}: {e}") from None
                if a in seen:  # one worker listed twice would count its seats twice
                    raise SettingError(name, f"{name}: {a!r} is listed twice")
                seen.add(a)
        from services.auth import load_api_keys
        try:
            load_api_keys(self.api_keys, self.api_key_file)  # readable, well-formed
        except ValueError as e:  # never shows a key
            raise SettingError("api_key_file" if "api_key_file" in str(e) else "api_keys",
                               str(e)) from None
        if bool(self.client_tls_cert_file) != bool(self.client_tls_key_file):
            raise SettingError("client_tls_cert_file", "client_tls_cert_file and "
                                                       "client_tls_key_file go together")
        if self.client_tls_ca_file and not self.client_tls_cert_file:
            raise SettingError("client_tls_ca_file", "client_tls_ca_file needs "
                                                     "client_tls_cert_file")


@dataclass(frozen=True, repr=False)
class WorkerSettings(ServiceSettings):
    """A worker process: its service side; the engine it runs is the ``engine`` section."""

    role: str = setting("colocated", "prefill, decode or colocated", choices=ROLES)
    port: int = _port(50061, "gRPC port (0: any free port)")
    advertise_host: str = setting("", "host others dial (default: host, or the hostname if "
                                      "host is a wildcard)", pattern=HOST)
    advertise_port: int = _port(0, "port others dial (0: the bound port; e.g. a proxy's)")
    worker_id: str = setting("", "unique id (default: advertise address + random suffix)",
                             pattern=ID_TEXT)
    registry_ttl_s: float = setting(3.0, "registry key TTL", gt=0.0)
    heartbeat_s: float = setting(0.5, "registry heartbeat interval (shorter than "
                                      "registry_ttl_s); also how soon a worker is listed "
                                      "again after Redis restarts empty", gt=0.0)
    kv_backend: str = setting(
        "auto", "KV transfer backend(s), preferred first: tcp, shm, nccl, cuda_ipc, nixl, "
                "fake, comma-separated (a failed transfer is retried on the next), or none; "
                f"auto: none for colocated, {DEFAULT_KV_BACKENDS['cuda']} on a GPU, "
                f"{DEFAULT_KV_BACKENDS['cpu']} on the CPU")
    kv_host: str = setting("", "KV receiver bind host (default: host)")
    peer_addrs: tuple[str, ...] = setting(
        (), "without Redis: the cluster members this worker may dial (prefill workers' "
            "host:port, decode workers' KV endpoints such as tcp://host:port); with Redis the "
            "registry says")
    kv_port: int = _port(0, "KV receiver port (0: any free port; several backends count up)")
    kv_advertise_port: int = _port(0, "KV receiver port others dial (0: the bound port; e.g. a "
                                      "proxy's; several backends count up)")
    transfer_timeout_s: float = setting(30.0, "KV transfer timeout (never past the request's "
                                              "deadline)", gt=0.0)
    kv_blocks_wait_s: float = setting(15.0, "decode role: how long a request whose prompt finds "
                                     "the KV cache full waits, in arrival order, for "
                                     "running requests to free blocks before "
                                     "RESOURCE_EXHAUSTED (at most half of "
                                     "transfer_timeout_s, never past the request's "
                                     "deadline; 0: refuse at once)", ge=0.0)
    prefill_timeout_s: float = setting(30.0, "decode role: a Prefill call's deadline, plus "
                                             "prefill_timeout_per_token_ms per prompt token "
                                             "(never past the request's deadline)", gt=0.0)
    prefill_timeout_per_token_ms: float = setting(1.0, "decode role: see prefill_timeout_s",
                                                  ge=0.0, le=60_000.0)
    grace_s: float = setting(30.0, "shutdown: time in-flight requests get to finish", ge=0.0)
    limits: RequestLimits = section(RequestLimits, "request limits")
    engine: EngineConfig = section(EngineConfig, "engine")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.engine, EngineConfig):
            raise SettingError("engine", "engine must be an EngineConfig")
        if not isinstance(self.limits, RequestLimits):
            raise SettingError("limits", "limits must be a RequestLimits")
        if self.advertise_host:
            problem = host_problem(bare_host(self.advertise_host))
            if problem:
                raise SettingError("advertise_host", f"advertise_host "
                                                     f"{self.advertise_host!r}: {problem}")
        if self.kv_host and not (self.tls or self.insecure or is_loopback(self.kv_host)):
            raise SettingError("kv_host", f"kv_host {self.kv_host!r} is not a loopback "
                                          f"address: give certificates or --insecure")
        for a in self.peer_addrs:
            try:
                _check_peer(a)
            except ValueError as e:
                raise SettingError("peer_addrs", f"peer_addrs: {e}") from None
        if self.heartbeat_s >= self.registry_ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be shorter than "
                             f"registry_ttl_s ({self.registry_ttl_s})")
        self._check_backends()

    def _check_backends(self) -> None:
        names = self.kv_backends
        raw = [b.strip() for b in self.kv_backend.split(",")]
        devices = backend_devices()
        if (self.kv_backend.strip() not in ("auto", "none")
                and (not names or "" in raw or any(b not in devices for b in names)
                     or len(set(names)) != len(names))):
            raise SettingError("kv_backend", f"kv_backend must be distinct names from "
                                             f"{', '.join(devices)}, comma-separated, auto "
                                             f"or none, got {self.kv_backend!r}")
        if not names and self.role != "colocated":
            raise SettingError("kv_backend", f"a {self.role} worker needs a kv_backend")
        if self.engine.device == "auto":
            return  # checked once the device is resolved (resolve_worker)
        kind = self.engine.device_kind
        wrong = [b for b in names if kind not in devices[b]]
        if wrong:
            gpu = "/".join(b for b, d in devices.items() if d == ("cuda",))
            raise SettingError("kv_backend", (
                f"kv_backend {','.join(wrong)} cannot move a KV cache on device "
                f"{self.engine.device!r}: {gpu} need a cuda device"))

    @property
    def kv_backends(self) -> tuple[str, ...]:
        """``nccl,tcp`` -> ``("nccl", "tcp")``: preferred first, then fallbacks; () for none
        (auto: the role's and device's default)."""
        value = self.kv_backend.strip()
        if value == "auto":
            value = default_kv_backend(self.role, self.engine.device_kind)
        if value == "none":
            return ()
        return tuple(b.strip() for b in value.split(",") if b.strip())

    @property
    def block_size(self) -> int:
        return self.engine.cache.block_size

    def advertised_host(self) -> str:
        """The host other processes dial (an IPv6 one without brackets)."""
        return bare_host(self.advertise_host or (
            socket.gethostname() if self.host in _WILDCARD_HOSTS else self.host))

    def advertise_address(self, bound_port: int | None = None) -> str:
        """host:port that other processes dial (``bound_port`` when port was 0; an IPv6
        host in brackets)."""
        return join_host_port(self.advertised_host(),
                              self.advertise_port or bound_port or self.port)


@dataclass(frozen=True)
class ClientSettings:
    """The gateway's clients: pdserve generate, chat and bench."""

    api_key: str = setting("", "API key sent to a gateway started with API keys "
                               "(authorization: Bearer); generate and chat also take "
                               "--api-key", secret=True)
    gil_switch_interval_us: float = _switch_interval()

    def __post_init__(self) -> None:
        check_settings(self)
        if self.api_key:
            from services.auth import api_key_problem
            problem = api_key_problem(self.api_key)
            if problem:
                raise SettingError("api_key", f"api_key {problem}")


ROOTS: dict[str, type] = {"engine": EngineConfig, "worker": WorkerSettings,
                          "gateway": GatewaySettings, "client": ClientSettings}


# ----------------------------------------------------------------------------- builders
def gateway_settings(argv: Sequence[str] | None = None,
                     env: Mapping[str, str] | None = None) -> GatewaySettings:
    """The gateway's settings from flags (``argv``; None: sys.argv[1:]) and ``env``."""
    import sys
    argv = sys.argv[1:] if argv is None else argv
    s, values = build(GatewaySettings, roots=ROOTS, argv=argv, env=env, sections=("gateway",),
                      prog="pdserve gateway")
    no_secret_flags(values)
    return s


# secrets a flag must not carry (ps shows every process's command line)
FLAG_REFUSED = ("redis_password",)


def no_secret_flags(values) -> None:
    """ConfigError when a :data:`FLAG_REFUSED` setting came from a flag (``--flag value``,
    ``--flag=value`` or an alias: ``values`` are build()'s, each with the option used).
    Every builder of a service's settings calls it (pdserve config show too)."""
    for name in FLAG_REFUSED:
        if name in values and values[name][1].startswith("-"):
            raise ConfigError(f"{name} is never taken from the command line (ps shows it): "
                              f"use PDSERVE_{name.upper()} or {name}_file")



def worker_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                    role: str = "colocated", resolve: bool = True) -> WorkerSettings:
    """A worker's settings; ``role`` is the default role (``--role`` / PDSERVE_ROLE override;
    the file tables that apply are ``[engine]``, ``[worker]`` and the role's). With
    ``resolve``, the device, the KV backends and the per-device engine limits are resolved
    (:func:`resolve_worker`)."""
    import sys
    argv = sys.argv[1:] if argv is None else argv

    def one(r: str):
        return build(WorkerSettings, roots=ROOTS, argv=argv, env=env, defaults={"role": r},
                     sections=worker_sections(r), prog=f"pdserve {role}")
    s, values = one(role)
    if s.role != role:  # set by --role, PDSERVE_ROLE or the file: its table applies instead
        s, values = one(s.role)
    no_secret_flags(values)
    return resolve_worker(s, values) if resolve else s


def worker_sections(role: str) -> tuple[str, ...]:
    """The config-file tables a worker of ``role`` reads, later ones winning."""
    return ("engine", "worker", role)


def resolve_worker(s: WorkerSettings, values=None,
                   cuda_available: bool | None = None) -> WorkerSettings:
    """``s`` with engine.device, kv_backend and the engine's per-device limits resolved (the
    dtype stays as set: "auto" depends on the checkpoint, which the engine reads)."""
    if cuda_available is None:
        import torch  # a worker has torch; the gateway never calls this
        cuda_available = torch.cuda.is_available()
    engine = replace(resolve_engine_config(s.engine, cuda_available=cuda_available),
                     dtype=s.engine.dtype)
    kv = s.kv_backend
    if kv.strip() == "auto":
        kv = default_kv_backend(s.role, engine.device_kind)
    try:
        return replace(s, engine=engine, kv_backend=kv)
    except SettingError as e:
        values = values or {}
        src = ", ".join(f"{n} set by {values[n][1]}" for n in dict.fromkeys((e.name, "device"))
                        if n in values and values[n][1] != "default")
        raise ConfigError(f"{e}" + (f" ({src})" if src else "")) from None


def engine_config(model: str | None = None, env: Mapping[str, str] | None = None,
                  config_file: str | None = None, **kw) -> EngineConfig:
    """The offline engine's settings (engine.llm.engine_config), strictly: an unknown
    variable or file key of any entry point is an error here (``pdserve run``)."""
    if model is not None:
        kw["model"] = model
    return build(EngineConfig, roots=ROOTS, env=env, keywords=kw, sections=("engine",),
                 config_file=config_file)[0]


def client_settings(env: Mapping[str, str] | None = None) -> ClientSettings:
    return build(ClientSettings, roots=ROOTS, env=env, sections=("client",))[0]


def setting_names(root: str) -> set[str]:
    """Flat names (aliases included) of one entry point's tree."""
    from pdcore.config_tree import aliases
    return set(aliases(ROOTS[root]))
