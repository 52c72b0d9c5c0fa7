"""Service settings: frozen dataclasses that only validate, and one factory per service.

Each field ``some_name`` can be set by the flag ``--some-name`` or the environment variable
``PDSERVE_SOME_NAME``; precedence: flag > environment > default. Booleans take
``--x/--no-x`` and ``1/0/true/false/yes/no/on/off``; tuples are comma-separated. Bad values
raise :class:`ConfigError` naming the flag and the variable; unknown flags are argparse errors.

    gateway_settings(argv=None, env=None) -> GatewaySettings
    worker_settings(argv=None, env=None, role="colocated") -> WorkerSettings
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
import os
import socket
from typing import Any, TypeVar

from engine.config import POLICIES

S = TypeVar("S")

ROLES = ("prefill", "decode", "colocated")
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class ConfigError(ValueError):
    """A setting has an invalid value; the message says which one and why."""


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _check_port(name: str, port: int, allow_zero: bool = True) -> None:
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise ValueError(f"{name} must be in {0 if allow_zero else 1}..65535, got {port}")


def _check_common(s: Any) -> None:
    _check_port("port", s.port)
    _check_port("metrics_port", s.metrics_port)
    if s.grace_s < 0 or s.drain_delay_s < 0:
        raise ValueError("grace_s and drain_delay_s must be >= 0")
    if s.max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be >= 1024, got {s.max_message_bytes}")
    if s.log_level.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {s.log_level!r}")
    if s.log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {s.log_format!r}")
    if s.redis_url and not s.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, "
                         f"got {s.redis_url!r}")
    if s.redis_timeout_s <= 0:
        raise ValueError("redis_timeout_s must be > 0")
    if s.block_size <= 0 or s.block_size & (s.block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {s.block_size}")
    if not s.model:
        raise ValueError("model must not be empty")


@dataclass(frozen=True)
class GatewaySettings:
    host: str = _opt("0.0.0.0", "address to bind")
    port: int = _opt(50051, "gRPC port (0: any free port)")
    model: str = _opt("smollm2-135m", "model spec; requests naming another model are refused")
    redis_url: str = _opt("", "Redis for registry + prefix index; empty: static workers only")
    namespace: str = _opt("pdserve", "Redis key prefix")
    redis_timeout_s: float = _opt(0.25, "Redis connect/read timeout")
    prefill_addrs: tuple[str, ...] = _opt((), "static prefill workers host:port,...")
    decode_addrs: tuple[str, ...] = _opt((), "static decode/colocated workers host:port,...")
    block_size: int = _opt(16, "KV block size in tokens (must match the workers)")
    hash_seed: str = _opt("pdserve-v1", "block-hash seed (must match the workers)")
    prefix_weight: float = _opt(1.0, "router: weight of cached prefix vs load")
    local_prefill_max_tokens: int = _opt(0, "router: a prompt with at most this many tokens "
                                            "uncached on the chosen decode worker is prefilled "
                                            "there, not on a prefill worker, while that prefill "
                                            "worker is backed up (see "
                                            "--local-prefill-queue-tokens); 0: off")
    local_prefill_queue_tokens: int = _opt(8192, "router: a prefill worker counts as backed up "
                                                 "when at least this many uncached prompt "
                                                 "tokens this gateway sent it await their first "
                                                 "token (0: always, i.e. every short prompt "
                                                 "prefills locally)")
    local_prefill_decode_tokens: int = _opt(0, "router: local prefill only while the decode "
                                               "worker's own such prompts awaiting their first "
                                               "token stay within this many uncached tokens "
                                               "(a decode worker that falls behind gets no "
                                               "more); 0: no cap")
    refresh_s: float = _opt(1.0, "how often to re-read the registry")
    reaper_interval_s: float = _opt(1.0, "how often to reap dead workers' index entries")
    request_timeout_s: float = _opt(600.0, "end-to-end deadline per request")
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata={
        "help": "accepted client API keys (prefer PDSERVE_API_KEYS or --api-key-file: flags "
                "show in ps); none: no auth"})
    api_key_file: str = _opt("", "file with one accepted client API key per line")
    grace_s: float = _opt(10.0, "shutdown: time in-flight requests get to finish")
    drain_delay_s: float = _opt(0.5, "shutdown: NOT_SERVING this long before refusing RPCs")
    max_message_bytes: int = _opt(64 * 1024 * 1024, "gRPC max message size")
    metrics_port: int = _opt(0, "Prometheus /metrics port (0: off)")
    log_level: str = _opt("INFO", "log level")
    log_format: str = _opt("json", "json or text")

    def __post_init__(self) -> None:
        _check_common(self)
        if not self.redis_url and not self.decode_addrs:
            raise ValueError("need redis_url or decode_addrs (where do workers come from?)")
        for a in (*self.prefill_addrs, *self.decode_addrs):
            _check_address(a)
        if self.prefix_weight < 0:
            raise ValueError("prefix_weight must be >= 0")
        for name in ("local_prefill_max_tokens", "local_prefill_queue_tokens",
                     "local_prefill_decode_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        from services.auth import load_api_keys
        load_api_keys(self.api_keys, self.api_key_file)  # readable, well-formed
        for name in ("refresh_s", "reaper_interval_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class WorkerSettings:
    role: str = _opt("colocated", "prefill, decode or colocated")
    host: str = _opt("0.0.0.0", "address to bind")
    port: int = _opt(50061, "gRPC port (0: any free port)")
    advertise_host: str = _opt("", "host others dial (default: host, or hostname if wildcard)")
    worker_id: str = _opt("", "unique id (default: advertise address + random suffix)")
    model: str = _opt("smollm2-135m", "model spec")
    dtype: str = _opt("float32", "float32, bfloat16 or float16")
    device: str = _opt("cpu", "cpu, cuda, cuda:N")
    seed: int = _opt(0, "engine seed")
    redis_url: str = _opt("", "Redis for registry + prefix index; empty: not registered")
    namespace: str = _opt("pdserve", "Redis key prefix")
    redis_timeout_s: float = _opt(0.25, "Redis connect/read timeout")
    registry_ttl_s: float = _opt(3.0, "registry key TTL")
    heartbeat_s: float = _opt(1.0, "registry heartbeat interval")
    kv_backend: str = _opt("tcp", "KV transfer backend(s), preferred first: tcp, shm, nccl, "
                                  "cuda_ipc, nixl, fake; e.g. nccl,tcp retries a failed "
                                  "transfer over tcp")
    kv_host: str = _opt("", "KV receiver bind host (default: host)")
    kv_port: int = _opt(0, "KV receiver port (0: any free port)")
    transfer_timeout_s: float = _opt(30.0, "KV transfer timeout")
    block_size: int = _opt(16, "KV block size in tokens")
    num_blocks: int = _opt(0, "KV blocks (0: derive from kv_cache_memory_bytes)")
    kv_cache_memory_bytes: int = _opt(1 << 30, "KV cache size when num_blocks is 0")
    enable_prefix_caching: bool = _opt(True, "reuse cached prompt prefixes")
    hash_seed: str = _opt("pdserve-v1", "block-hash seed (same on every process)")
    max_num_seqs: int = _opt(64, "max running requests")
    max_num_batched_tokens: int = _opt(2048, "per-step token budget")
    max_model_len: int = _opt(4096, "max prompt + output tokens")
    schedule_policy: str = _opt("fcfs", "admission order of waiting requests: fcfs, or "
                                        "short_first (fewest prompt tokens left first; one "
                                        "waiting over --schedule-max-wait-s goes first)")
    schedule_max_wait_s: float = _opt(1.0, "short_first: wait after which a request goes "
                                           "before newer ones")
    enforce_eager: bool = _opt(False, "GPU: no CUDA graphs")
    mixed_graph_tokens: int = _opt(512, "GPU: steps that mix decodes with prompt chunks of "
                                        "up to this many tokens replay CUDA graphs (0: eager)")
    async_decode: bool | None = _opt(None, "launch the next decode step before reading this "
                                            "one's tokens (hides host work behind the GPU); "
                                            "unset: on with CUDA graphs, off otherwise")
    num_threads: int = _opt(0, "CPU: torch threads (0: torch default)")
    grace_s: float = _opt(30.0, "shutdown: time in-flight requests get to finish")
    drain_delay_s: float = _opt(0.5, "shutdown: NOT_SERVING this long before refusing RPCs")
    max_message_bytes: int = _opt(64 * 1024 * 1024, "gRPC max message size")
    metrics_port: int = _opt(0, "Prometheus /metrics port (0: off)")
    log_level: str = _opt("INFO", "log level")
    log_format: str = _opt("json", "json or text")

    def __post_init__(self) -> None:
        _check_common(self)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        from kvtransfer import registry  # the one list of KV backends and their devices

        known = tuple(registry.backends())
        bad = [b for b in self.kv_backends if b not in known]
        if bad or not self.kv_backends or len(set(self.kv_backends)) != len(self.kv_backends):
            raise ValueError(f"kv_backend must be distinct names from {known}, "
                             f"comma-separated, got {self.kv_backend!r}")
        kind = "cuda" if self.device.startswith("cuda") else "cpu"
        wrong = [b for b in self.kv_backends if not registry.spec(b).serves(kind)]
        if wrong:
            raise ValueError(
                f"kv_backend {','.join(wrong)} cannot move a KV cache on device {self.device!r}: "
                f"{registry.device_rules()}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        _check_port("kv_port", self.kv_port)
        if self.heartbeat_s <= 0 or self.heartbeat_s >= self.registry_ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be > 0 and shorter than "
                             f"registry_ttl_s ({self.registry_ttl_s})")
        for name in ("num_blocks", "num_threads", "mixed_graph_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, "
                             f"got {self.schedule_policy!r}")
        for name in ("transfer_timeout_s", "kv_cache_memory_bytes", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "schedule_max_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def kv_backends(self) -> tuple[str, ...]:
        """``--kv-backend nccl,tcp`` -> ``("nccl", "tcp")``: preferred first, then fallbacks."""
        return tuple(b.strip() for b in self.kv_backend.split(",") if b.strip())

    def advertise_address(self, bound_port: int | None = None) -> str:
        """host:port that other processes dial (``bound_port`` when port was 0)."""
        host = self.advertise_host or (socket.gethostname() if self.host in _WILDCARD_HOSTS
                                       else self.host)
        return f"{host}:{bound_port or self.port}"


def _check_address(a: str) -> None:
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"expected host:port, got {a!r}")


def _names(name: str) -> tuple[str, str]:
    return "--" + name.replace("_", "-"), "PDSERVE_" + name.upper()


def _is_bool(kind: str) -> bool:
    """A field annotated bool, or bool | None (unset: the component decides)."""
    return kind.replace(" ", "") in ("bool", "bool|None")


def _parse(kind: str, raw: str) -> Any:
    kind = kind.replace(" ", "")
    if kind in ("int", "float"):
        try:
            return int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind == 'int' else 'a number'}, "
                             f"got {raw!r}") from None
    if _is_bool(kind):
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")
    if kind.startswith("tuple"):
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    return raw


def _build(cls: type[S], prog: str, argv: Sequence[str] | None, env: Mapping[str, str] | None,
           defaults: Mapping[str, Any] | None = None) -> S:
    env = os.environ if env is None else env
    defaults = defaults or {}
    parser = argparse.ArgumentParser(prog=prog, description=f"{cls.__name__}: flag > "
                                     "PDSERVE_* environment variable > default")
    for f in fields(cls):
        flag, var = _names(f.name)
        default = defaults.get(f.name, f.default if f.default is not MISSING else None)
        help_ = f"{f.metadata.get('help', '')} [{var}; default {default!r}]"
        if _is_bool(f.type):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                                help=help_)
    ns = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in fields(cls):
        flag, var = _names(f.name)
        raw = getattr(ns, f.name)
        source = f"{flag} / {var}"
        if raw is None and var in env:
            raw, source = env[var], f"{var} (environment) / {flag}"
        if raw is None:
            if f.name in defaults:
                values[f.name] = defaults[f.name]
            continue
        try:
            values[f.name] = raw if isinstance(raw, bool) else _parse(f.type, raw)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    try:
        return cls(**values)
    except ValueError as e:
        raise ConfigError(f"invalid {cls.__name__}: {e} (field x_y is set by --x-y or "
                          "PDSERVE_X_Y)") from None


def gateway_settings(argv: Sequence[str] | None = None,
                     env: Mapping[str, str] | None = None) -> GatewaySettings:
    """The gateway's settings from flags (``argv``, default sys.argv[1:]) and ``env``."""
    return _build(GatewaySettings, "pdserve gateway", argv, env)


def worker_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                    role: str = "colocated") -> WorkerSettings:
    """A worker's settings; ``role`` is the default role (``--role``/PDSERVE_ROLE override)."""
    return _build(WorkerSettings, f"pdserve {role}", argv, env, defaults={"role": role})
