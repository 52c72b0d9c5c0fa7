"""What a service checks before it loads or serves anything, and the one-line error of a
start that failed (pdserve gateway | prefill | decode | colocated; pdserve up and run follow
the same rule).

Exit status of a command that cannot start: **2** when a value the user gave is wrong (a
flag, variable or config-file value; a file it names that cannot be read or used: a
certificate, key, password or model; a host that is not an address of this machine), **1**
when this machine refuses what was asked of it (a port another process holds, a privileged
port). Either way one line ``error: ...`` on stderr, never a traceback.

    check_service(settings, role, who, listens)   files and addresses, before anything starts
    binding(what, host, port)                     around a bind at serve time: StartError
    engine_starting()                             around an engine's construction: StartError
    catch_interrupts() / check_interrupted()      Ctrl-C while it starts: exit 130, never ignored
    start_failure_reason(output, status, timeout_s)  a started process's one line, from its
                                                  output (pdserve up and bench --up)
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
import contextlib
import errno
import logging
import os
import signal
import socket
import threading

from pdcore.hostport import bare_host, join_host_port

logger = logging.getLogger(__name__)

BAD_VALUE = 2
ENVIRONMENT = 1


class StartError(Exception):
    """A service cannot start: the message is one line; ``status`` the exit status
    (:data:`BAD_VALUE` or :data:`ENVIRONMENT`)."""

    def __init__(self, message: str, status: int = BAD_VALUE):
        super().__init__(" ".join(str(message).split()))  # one line, whatever it quotes
        self.status = status


@contextlib.contextmanager
def engine_starting() -> Iterator[None]:
    """Around an engine's construction (a worker's, ``pdserve run``'s): a model, plan or
    weights file it cannot use; a KV cache the memory cannot hold (MemoryError on the CPU,
    torch.OutOfMemoryError on a GPU); the device's own errors: ``StartError("the engine
    cannot start: <reason>")`` (exit 2)."""
    try:
        yield
    except (ValueError, OSError, MemoryError, RuntimeError) as e:
        logger.debug("the engine did not start", exc_info=True)
        raise StartError(f"the engine cannot start: {e}") from None


def probe_bind(host: str, port: int) -> OSError | None:
    """Bind ``host:port`` as the servers do (SO_REUSEADDR) and let it go at once: None when
    some address of ``host`` binds, else the error (a port in use named first)."""
    try:
        infos = socket.getaddrinfo(bare_host(host) or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return e
    errors = []
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
            return None
        except OSError as e:
            errors.append(e)
    errors.sort(key=lambda e: e.errno != errno.EADDRINUSE)
    return errors[0] if errors else OSError(errno.EADDRNOTAVAIL, "no address to bind")


def bind_failure(what: str, host: str, port: int, error: BaseException | None) -> StartError:
    """The one-line error of ``what`` (e.g. "the gRPC port (--host, --port)") that could not
    listen on ``host:port``; ``error`` None or without an errno: found out by binding now."""
    if not isinstance(error, OSError) or not error.errno:
        error = probe_bind(host, port) or error
    where = f"cannot listen on {join_host_port(host or '0.0.0.0', port)} ({what})"
    code = getattr(error, "errno", None)
    if isinstance(error, socket.gaierror) or (code is not None and code < 0):
        detail = f" ({error.strerror})" if isinstance(error, socket.gaierror) else ""
        return StartError(f"{where}: host {bare_host(host)!r} does not resolve{detail}",
                          BAD_VALUE)
    if code in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return StartError(f"{where}: {bare_host(host)!r} is not an address of this machine",
                          BAD_VALUE)
    if code == errno.EADDRINUSE:
        return StartError(f"{where}: address already in use (another process holds the "
                          "port: stop it, or pick another port; 0 takes any free one)",
                          ENVIRONMENT)
    if code == errno.EACCES:
        return StartError(f"{where}: permission denied (ports below 1024 need privileges)",
                          ENVIRONMENT)
    if code:
        return StartError(f"{where}: {os.strerror(code).lower()}", ENVIRONMENT)
    reason = " ".join(str(error).split()) if error is not None else ""
    return StartError(f"{where}: {reason or 'the address or its TLS credentials were refused'}",
                      ENVIRONMENT)


def check_listen(what: str, host: str, port: int) -> None:
    """StartError unless ``host:port`` can be bound now (port 0: that ``host`` can)."""
    error = probe_bind(host, port)
    if error is not None:
        raise bind_failure(what, host, port, error)


@contextlib.contextmanager
def binding(what: str, host: str, port: int) -> Iterator[None]:
    """Around a server's bind: an OSError (or gRPC's RuntimeError) becomes the
    :class:`StartError` naming the address and why."""
    import ssl
    try:
        yield
    except StartError:
        raise
    except ssl.SSLError as e:  # the port's certificate files (checked before, normally)
        raise StartError(f"{what}: unusable TLS certificate or key: {e.reason or e}",
                         BAD_VALUE) from None
    except OSError as e:
        if e.errno is not None and e.errno >= 0 and e.errno not in _BIND_ERRNOS:
            raise  # not the bind's (a backend's own resource, say)
        raise bind_failure(what, host, port, e) from None


_BIND_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EACCES,
                errno.EPERM)


def check_service(settings, role: str, who: str,
                  listens: Iterable[tuple[str, str, int]] = ()) -> None:
    """What a service can check before it loads or serves anything: its cluster certificate
    (readable, signed by the CA, of ``role``; ``who`` names the service in the error), its
    other TLS files (the client port's, the metrics port's), the Redis password file
    (ValueError for any: exit 2), then each ``(what, host, port)`` it will listen on
    (:class:`StartError`; port 0: the host only)."""
    from services.tls import check_key_pair
    if settings.tls_cert_file:
        from services.tls import cluster_tls
        tls = cluster_tls(settings)  # readable, signed by the CA, carrying a role
        if tls.role != role:
            raise ValueError(f"{settings.tls_cert_file} is a {tls.role} certificate; "
                             f"{who} needs a {role} one")
    for prefix in ("client_tls", "metrics_tls"):
        cert = getattr(settings, f"{prefix}_cert_file", "")
        if cert:
            check_key_pair(cert, getattr(settings, f"{prefix}_key_file"),
                           getattr(settings, f"{prefix}_ca_file"), prefix)
    settings.redis_auth()  # the password file is readable
    for what, host, port in listens:
        check_listen(what, host, port)


def start_failure_reason(log: list[str], returncode: int | None, timeout_s: float) -> str:
    """One line saying why a service process did not start, from its output lines: its own
    ``error: ...`` line (the rule above), else a timeout or the last line it printed."""
    for line in reversed(log):
        if line.startswith("error: "):
            return line[len("error: "):].strip()
    if returncode is None:
        return f"not ready after {timeout_s:g} s"
    for line in reversed(log):  # a traceback's last line, a log line at ERROR
        if line.strip() and not line.startswith((" ", "Traceback")):
            return f"exited with status {returncode}: {' '.join(line.split())}"
    return f"exited with status {returncode}"


# ------------------------------------------------------------------ Ctrl-C while starting
_interrupted = False


def _on_interrupt(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def catch_interrupts() -> None:
    """From now until a service installs its own handlers (a drain:
    services.grpc_server.GrpcServer.install_signal_handlers), Ctrl-C raises KeyboardInterrupt
    where the start is, as Python's default handler does, and is remembered: third-party
    code that catches everything (an import inside torch did) cannot make the start go on
    to serve; :func:`check_interrupted` raises it again. Replaces only Python's default
    handler, in the main thread (a caller's own handler stays)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _on_interrupt)


def check_interrupted() -> None:
    """KeyboardInterrupt if Ctrl-C came since :func:`catch_interrupts` (even if whatever it
    interrupted swallowed it)."""
    if _interrupted:
        raise KeyboardInterrupt
