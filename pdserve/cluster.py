"""A whole local cluster in real processes: a private redis-server, prefill, decode and
colocated workers, and a gateway, on free ports. Used by ``pdserve up``, the integration tests
and the benchmarks, so all three run the product the same way.

Secure by default: a throw-away CA and one certificate per role (minted once per process,
in a private temporary folder removed at exit), mutual TLS between every service, Redis with
a password (given to the services in a file, never on a command line), signed registry
entries, Redis over TLS (``rediss://``, a certificate of the role ``redis``).
``secure=False`` (``pdserve up --insecure``) runs everything plaintext with
``--insecure``. The gateway's client port stays plaintext on 127.0.0.1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import atexit
import functools
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from pdcore.config_tree import child_environ
from services.startup import start_failure_reason

logger = logging.getLogger(__name__)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Run before a child's program: the kernel sends the child SIGTERM when this process ends,
# however it ends (SIGKILL included), so a killed test run or bench driver leaves no
# workers or redis-server behind (Linux; elsewhere the program is run as it is).
_GUARD = ("import ctypes, os, signal, sys\n"
          "try:\n"
          "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
          "except (OSError, AttributeError):\n"
          "    pass\n"
          "if os.getppid() != int(sys.argv[1]):\n"
          "    sys.exit(1)  # the parent ended before the guard was set\n"
          "os.execvp(sys.argv[2], sys.argv[2:])\n")


def orphan_guard() -> list[str]:
    """The command prefix that ties a child's life to this process (see _GUARD)."""
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-c", _GUARD, str(os.getpid())]

# Set in every process of a cluster that uses a GPU: NVLink multicast (NVLS) must stay off on
# the machines we run on (NCCL, torch symmetric memory and NVSHMEM would each try to use it).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}


# what a service prints when a port it was given is taken (uvicorn / asyncio, gRPC)
_PORT_TAKEN = ("address already in use", "errno 98", "failed to bind", "no address added")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")
            time.sleep(0.02)


@dataclass(frozen=True)
class RedisTls:
    """A Redis server's TLS material: its certificate and key, and the CA clients trust
    (and, with ``client_ca_file``, the CA whose certificates clients must show)."""

    cert_file: str
    key_file: str
    ca_file: str
    client_ca_file: str = ""


class RedisProcess:
    """A private redis-server (no persistence) that can be killed and restarted; with
    ``password`` it requires it (given on its stdin: never on a command line); with ``tls``
    it listens for TLS only (``rediss://``; the build must link OpenSSL, as Debian's does)."""

    def __init__(self, port: int | None = None, password: str | None = None,
                 tls: RedisTls | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install -y redis-server)")
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The address, without credentials (what services are given)."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def client_url(self) -> str:
        """The address with the password (and the CA to trust) in it, for in-process clients
        (tests); never passed to a process or printed."""
        url = self.url
        if self.password:
            url = url.replace("://", f"://:{self.password}@", 1)
        if self.tls:
            url += f"?ssl_ca_certs={self.tls.ca_file}"
        return url

    def _tls_conf(self) -> str:
        t = self.tls
        return (f"port 0\ntls-port {self.port}\ntls-cert-file {t.cert_file}\n"
                f"tls-key-file {t.key_file}\ntls-ca-cert-file {t.client_ca_file or t.ca_file}\n"
                f"tls-auth-clients {'yes' if t.client_ca_file else 'no'}\n"
                f"tls-protocols \"TLSv1.2 TLSv1.3\"\n")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        conf = (f"port {self.port}\nbind 127.0.0.1\nsave \"\"\nappendonly no\n"
                f"protected-mode no\nloglevel warning\n")
        if self.password:
            conf += f"requirepass {self.password}\n"
        if self.tls:
            conf += self._tls_conf()
        self.proc = subprocess.Popen([*orphan_guard(), self.binary, "-"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proc.stdin.write(conf.encode())
        self.proc.stdin.close()
        try:
            wait_port(self.port)
        except TimeoutError:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.proc = None


@functools.cache
def cluster_identity():
    """This process's throw-away cluster identity (services.tls.ClusterFiles): a CA, a
    certificate per role and a Redis password, minted once, removed at exit."""
    import tempfile
    from services.tls import write_cluster_files
    directory = tempfile.mkdtemp(prefix="pdserve-certs-")
    atexit.register(shutil.rmtree, directory, True)
    return write_cluster_files(directory)


def worker_channel(address: str, role: str = "gateway", identity=None):
    """A grpc.aio channel to a service of a cluster, with ``identity``'s certificate of
    ``role`` (None: plaintext, for an insecure cluster)."""
    import grpc
    if identity is None:
        return grpc.aio.insecure_channel(address)
    from services.tls import CLUSTER_NAME

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()
    creds = grpc.ssl_channel_credentials(read(identity.ca_file), read(identity.key(role)),
                                         read(identity.cert(role)))
    return grpc.aio.secure_channel(address, creds,
                                   options=[("grpc.ssl_target_name_override", CLUSTER_NAME)])


def operator_channels(address: str) -> list:
    """Ways to open a channel to a worker of a local cluster, to try in turn: as an operator
    with this process's cluster identity (when one was minted), then plaintext."""
    import grpc
    makers = []
    if cluster_identity.cache_info().currsize:
        makers.append(lambda: worker_channel(address, "operator", cluster_identity()))
    makers.append(lambda: grpc.aio.insecure_channel(address))
    return makers


class StartFailed(RuntimeError):
    """A service of a cluster did not start. ``reason``: one line, the service's own
    ``error: ...`` line when it printed one; ``status``: what a command reporting it should
    exit with (the service's own 1 or 2; 1 otherwise). str(): the kind and the log's tail."""

    def __init__(self, svc: "Service", returncode: int | None, timeout_s: float):
        self.kind = svc.kind
        self.returncode = returncode
        self.log = list(svc.log)
        self.status = returncode if returncode in (1, 2) else 1
        self.reason = start_failure_reason(self.log, returncode, timeout_s)
        tail = "\n".join(self.log[-30:])
        super().__init__(f"{svc.kind} did not start:\n{tail}")


@dataclass(eq=False)  # a process: equal only to itself (hashable)
class Service:
    kind: str  # gateway | prefill | decode | colocated
    proc: subprocess.Popen
    address: str = ""
    worker_id: str = ""
    metrics_port: int = 0  # Prometheus /metrics port (LocalCluster(metrics=True))
    http_port: int = 0  # a gateway's OpenAI HTTP port (LocalCluster(http_port=...))
    log: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)  # its command-line flags (for a restart)
    restarts: list[float] = field(default_factory=list)  # monotonic times of its restarts

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _pump(svc: Service, ready: threading.Event, echo: bool) -> None:
    for raw in svc.proc.stdout:
        line = raw.rstrip("\n")
        svc.log.append(line)
        if len(svc.log) > 2000:
            del svc.log[:1000]
        if echo:
            print(f"[{svc.kind}] {line}", flush=True)
        if line.startswith("READY ") and not ready.is_set():
            parts = line.split()
            svc.address = parts[2]
            for p in parts[3:]:
                if p.startswith("worker_id="):
                    svc.worker_id = p.split("=", 1)[1]
                elif p.startswith("metrics="):
                    svc.metrics_port = int(p.split("=", 1)[1])
                elif p.startswith("http="):
                    svc.http_port = int(p.split("=", 1)[1])
            ready.set()


def _check_devices(devices: dict[str, list[str]] | None, counts: dict[str, int],
                   worker_args, role_args: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    devices = {role: list(ds) for role, ds in (devices or {}).items()}
    for role, ds in devices.items():
        if role not in counts:
            raise ValueError(f"devices: unknown role {role!r} (one of {', '.join(counts)})")
        if not ds or not all(isinstance(d, str) and d for d in ds):
            raise ValueError(f"devices[{role!r}] must be a non-empty list of device names")
    for role in role_args:
        if role not in counts:
            raise ValueError(f"role_args: unknown role {role!r} (one of {', '.join(counts)})")
    if devices and ("--device" in worker_args
                    or any("--device" in a for a in role_args.values())):
        raise ValueError("give the device either in devices or as --device in worker_args")
    return devices


class LocalCluster:
    """``devices`` gives each worker its ``--device``: role -> one device per worker of that
    role, in start order (``{"prefill": ["cuda:0"], "decode": ["cuda:1"]}``, ``{"colocated":
    ["cuda:0", "cuda:1"]}``); workers started later with :meth:`start_worker` cycle through
    their role's list. Every worker still sees every GPU (CUDA_VISIBLE_DEVICES is left alone:
    GPU-to-GPU KV transfer needs both devices visible), and when any device is a GPU every
    process gets :data:`GPU_ENV`. Roles left out (and ``devices=None``) keep the worker
    default (CPU).

    ``worker_args`` go to every worker, then ``role_args[role]`` to the workers of that role
    only (``{"decode": ("--max-num-batched-tokens", "512")}``; later flags win).

    ``kv_backend`` None leaves each worker its default (kv_backend auto: tcp on the CPU,
    cuda_ipc,nccl on a GPU, none for colocated workers). Workers sharing one GPU split its
    memory: each gets gpu_memory_utilization / (workers on that GPU), unless the flags give
    the worker its own --gpu-memory-utilization, --kv-cache-memory-bytes or --num-blocks."""

    def __init__(self, model: str = "smollm2-135m", *, prefill: int = 1, decode: int = 1,
                 colocated: int = 0, gateway_port: int = 0, redis: bool = True,
                 kv_backend: str | None = None, worker_args: tuple[str, ...] = (),
                 gateway_args: tuple[str, ...] = (), env: dict | None = None, echo: bool = False,
                 startup_timeout_s: float = 180.0, metrics: bool = False,
                 devices: dict[str, list[str]] | None = None,
                 role_args: dict[str, tuple[str, ...]] | None = None, secure: bool = True,
                 http_port: int | None = None, redis_tls: bool | None = None):
        self.model = model
        self.secure = secure
        # Redis over TLS (rediss://, the cluster CA's "redis" certificate): default when secure
        self.redis_tls = secure if redis_tls is None else redis_tls
        if self.redis_tls and not secure:
            raise ValueError("redis_tls needs secure=True (the cluster CA)")
        self.identity = cluster_identity() if secure else None
        self.http_port = http_port  # the gateway's OpenAI HTTP API: None off, 0 a free port
        self.counts = {"prefill": prefill, "decode": decode, "colocated": colocated}
        self.role_args = {role: tuple(a) for role, a in (role_args or {}).items()}
        self.devices = _check_devices(devices, self.counts, worker_args, self.role_args)
        self.gateway_port = gateway_port
        self.use_redis = redis
        self.kv_backend = kv_backend
        self.worker_args = tuple(worker_args)
        self.gateway_args = tuple(gateway_args)
        self.env = child_environ({"PYTHONUNBUFFERED": "1", **(env or {})})
        self.env["PYTHONPATH"] = REPO + os.pathsep + self.env.get("PYTHONPATH", "")
        if any(d.startswith("cuda") for ds in self.devices.values() for d in ds):
            self.env.update(GPU_ENV)
        self.echo = echo
        self.metrics = metrics  # give every service its own free --metrics-port
        self.timeout = startup_timeout_s
        self.redis: RedisProcess | None = None
        self.workers: list[Service] = []
        self.gateway: Service | None = None

    @property
    def address(self) -> str:
        return self.gateway.address if self.gateway else ""

    @property
    def http_address(self) -> str:
        """The gateway's OpenAI HTTP API as host:port ("" when off)."""
        if not (self.gateway and self.gateway.http_port):
            return ""
        return f"127.0.0.1:{self.gateway.http_port}"

    @property
    def redis_url(self) -> str:
        """Redis with its password in the URL (in-process clients, tests)."""
        return self.redis.client_url if self.redis else ""

    def redis_args(self) -> list[str]:
        """A service's Redis flags: the URL, and for a TLS Redis the CA to trust."""
        if not self.redis:
            return []
        args = ["--redis-url", self.redis.url]
        if self.redis.tls:
            args += ["--redis-tls-ca-file", self.redis.tls.ca_file]
        return args

    def security_args(self, role: str) -> list[str]:
        """A service's identity flags: its certificate and the Redis password file, or
        --insecure."""
        return self.identity.flags(role) if self.identity is not None else ["--insecure"]

    def worker_channel(self, address: str, role: str = "gateway"):
        """A grpc.aio channel to a worker as a service of ``role`` would open it (tests,
        operators: ``role="operator"`` may call Stats)."""
        return worker_channel(address, role, self.identity)

    def _spawn(self, kind: str, args: list[str]) -> Service:
        if self.metrics:
            args = [*args, "--metrics-port", str(free_port())]
        cmd = [*orphan_guard(), sys.executable, "-m", "pdserve.cli", kind, *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=REPO, start_new_session=True)
        svc = Service(kind, proc, args=list(args))
        ready = threading.Event()
        pump = threading.Thread(target=_pump, args=(svc, ready, self.echo), daemon=True)
        pump.start()
        svc._ready = ready  # type: ignore[attr-defined]
        svc._pump = pump  # type: ignore[attr-defined]
        return svc

    def _wait_ready(self, svcs: list[Service], stop_on_failure: bool = True) -> None:
        deadline = time.monotonic() + self.timeout
        for svc in svcs:
            while not svc._ready.wait(0.2):  # type: ignore[attr-defined]
                if not svc.alive or time.monotonic() > deadline:
                    timed_out = svc.alive
                    if stop_on_failure:
                        self.stop()
                    elif svc.alive:
                        os.killpg(svc.proc.pid, 9)
                    svc.proc.wait(10)
                    svc._pump.join(2)  # type: ignore[attr-defined] # its last lines read
                    raise StartFailed(svc, None if timed_out else svc.proc.returncode,
                                      self.timeout)

    def device_for(self, role: str, index: int) -> str | None:
        """The ``--device`` of the ``index``-th worker of ``role`` (None: worker default)."""
        ds = self.devices.get(role)
        return ds[index % len(ds)] if ds else None

    def workers_on(self, device: str) -> int:
        """How many of the configured workers run on the GPU ``device`` (0 for the CPU;
        "cuda" counts as the current device, cuda:0)."""
        def gpu(d: str | None) -> str | None:
            if not d or not d.startswith("cuda"):
                return None
            return d if ":" in d else "cuda:0"
        target = gpu(device)
        if target is None:
            return 0
        return sum(gpu(self.device_for(role, i)) == target
                   for role, n in self.counts.items() for i in range(n))

    def worker_cmd_args(self, role: str, index: int = 0) -> list[str]:
        """Flags of the ``index``-th worker of ``role`` (the index picks its device)."""
        args = ["--model", self.model, "--host", "127.0.0.1", "--port", "0",
                "--log-format", "text", "--log-level", "WARNING"]
        if self.kv_backend is not None:
            args += ["--kv-backend", self.kv_backend]
        args += self.redis_args()
        args += self.security_args(role)
        device = self.device_for(role, index)
        extra = [*self.worker_args, *self.role_args.get(role, ())]
        if device is not None:
            args += ["--device", device]
            sharing = self.workers_on(device)
            if sharing > 1 and not {"--gpu-memory-utilization", "--kv-cache-memory-bytes",
                                    "--num-blocks"} & set(extra):
                from engine.config import CacheConfig
                share = CacheConfig().gpu_memory_utilization / sharing
                args += ["--gpu-memory-utilization", f"{share:.4f}"]
        if "--num-threads" not in extra:
            # several workers share this machine's cores: more torch threads than cores per
            # process makes OpenMP threads wait on each other (steps several times slower)
            n = sum(self.counts.values()) or 1
            args += ["--num-threads", str(max(1, (os.cpu_count() or 1) // n))]
        return args + extra

    def gateway_cmd_args(self) -> list[str]:
        """The gateway's flags: Redis when the cluster has it, else the started workers."""
        args = ["--model", self.model, "--host", "127.0.0.1", "--port", str(self.gateway_port),
                "--log-format", "text", "--log-level", "WARNING", "--http-port",
                str(0 if self.http_port is None else self.http_port or free_port())]
        args += self.redis_args()
        args += self.security_args("gateway")
        if not self.redis and not self.use_redis:
            dec = [w.address for w in self.workers if w.kind in ("decode", "colocated")]
            pre = [w.address for w in self.workers if w.kind == "prefill"]
            args += ["--decode-addrs", ",".join(dec)]
            if pre:
                args += ["--prefill-addrs", ",".join(pre)]
        return args + list(self.gateway_args)

    def start_worker(self, role: str, extra: tuple[str, ...] = (), wait: bool = True) -> Service:
        index = sum(w.kind == role for w in self.workers)
        svc = self._spawn(role, self.worker_cmd_args(role, index) + list(extra))
        self.workers.append(svc)
        if wait:
            self._wait_ready([svc])
        return svc

    def start(self) -> "LocalCluster":
        if self.use_redis:
            password = None
            if self.identity is not None:
                with open(self.identity.redis_password_file) as f:
                    password = f.read().strip()
            tls = None
            if self.redis_tls:
                ident = self.identity
                tls = RedisTls(ident.cert("redis"), ident.key("redis"), ident.ca_file)
            self.redis = RedisProcess(password=password, tls=tls)
            self.redis.start()
        new = []
        for role, n in self.counts.items():
            for i in range(n):
                svc = self._spawn(role, self.worker_cmd_args(role, i))
                self.workers.append(svc)
                new.append(svc)
        self._wait_ready(new)
        self._start_gateway()
        if self.redis:
            self.wait_workers_registered()
        return self

    def _start_gateway(self) -> None:
        """Spawn the gateway; when it could not bind a port picked free a moment before
        (another process took it meanwhile: its HTTP or metrics port), again with fresh
        ones. A port given explicitly is not retried."""
        attempts = 3 if self.http_port == 0 or self.metrics else 1
        for attempt in range(attempts):
            self.gateway = self._spawn("gateway", self.gateway_cmd_args())
            try:
                self._wait_ready([self.gateway], stop_on_failure=False)
                return
            except RuntimeError as e:
                text = str(e).lower()
                if attempt + 1 < attempts and any(m in text for m in _PORT_TAKEN):
                    logger.warning("gateway could not bind its port; starting it again")
                    continue
                self.stop()
                raise

    def wait_workers_registered(self, timeout_s: float = 15.0) -> None:
        """Block until the registry lists every live worker (the gateway refreshes each 1 s)."""
        import redis as redis_sync
        r = redis_sync.Redis.from_url(self.redis.client_url)
        want = {w.worker_id for w in self.workers if w.alive}
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                have = {k.decode().split("pdserve:worker:", 1)[1]
                        for k in r.keys("pdserve:worker:*")}
                if want <= have:
                    # the gateway lists the registry every 1 s (after the listing itself):
                    # two periods, so a listing that was under way, slow or failed once
                    # under load still leaves one that sees them
                    time.sleep(2.2)
                    return
                time.sleep(0.1)
        finally:
            r.close()
        raise TimeoutError("workers did not register")

    def kill(self, svc: Service) -> None:
        """SIGKILL a service (a crash)."""
        if svc.alive:
            os.killpg(svc.proc.pid, 9)
            svc.proc.wait(10)

    def pause(self, svc: Service) -> None:
        """SIGSTOP a service (a hung process: its sockets stay open, nothing answers)."""
        os.killpg(svc.proc.pid, 19)

    def resume(self, svc: Service) -> None:
        os.killpg(svc.proc.pid, 18)

    # ----------------------------------------------------------- supervision
    def restart(self, svc: Service) -> Service:
        """Start a dead service again with the same flags (a worker gets a new port and
        incarnation id; gateways learn of it from the registry). Returns the new Service."""
        new = self._spawn(svc.kind, svc.args)
        new.restarts = svc.restarts + [time.monotonic()]
        if svc is self.gateway:
            self.gateway = new
        else:
            self.workers[self.workers.index(svc)] = new
        self._wait_ready([new], stop_on_failure=False)
        return new

    def supervise_once(self, max_restarts: int = 5, window_s: float = 60.0) -> list[str]:
        """Restart every service (and the private Redis) that exited; a service that needed
        more than ``max_restarts`` restarts within ``window_s`` is left down. Returns what
        happened, one line per service acted on."""
        events = []
        if self.redis is not None and not self.redis.running:
            self.redis.start()
            events.append(f"redis on :{self.redis.port} exited; restarted")
        for svc in ([self.gateway] if self.gateway else []) + list(self.workers):
            if svc.alive or getattr(svc, "given_up", False):
                continue
            recent = [t for t in svc.restarts if t > time.monotonic() - window_s]
            if len(recent) >= max_restarts:
                svc.given_up = True  # type: ignore[attr-defined]
                events.append(f"{svc.kind} {svc.address} keeps exiting "
                              f"(rc {svc.proc.returncode}); left down")
                continue
            try:
                new = self.restart(svc)
                events.append(f"{svc.kind} {svc.address} exited (rc {svc.proc.returncode}); "
                              f"restarted as {new.address}")
            except RuntimeError as e:
                svc.restarts.append(time.monotonic())
                events.append(f"{svc.kind} {svc.address} exited; restart failed: {e}")
        return events

    def stop(self) -> None:
        svcs = ([self.gateway] if self.gateway else []) + self.workers
        for svc in svcs:
            if svc.alive:
                try:
                    os.killpg(svc.proc.pid, 15)
                except ProcessLookupError:
                    pass
        for svc in svcs:
            try:
                svc.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(svc.proc.pid, 9)
                svc.proc.wait(5)
        if self.redis:
            self.redis.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
