"""Cluster identity: mutual TLS between services, role-carrying certificates, signed entries.

Every internal hop (gateway -> workers, decode -> prefill, a prefill worker's KV sender ->
a decode worker's receiver) runs over TLS where **both** sides present a certificate that
the cluster CA signed. Each certificate carries its service's role (a URI SAN
``urn:pdserve:role:<role>``, one of :data:`ROLES`) and the cluster name
:data:`CLUSTER_NAME` (a DNS SAN every client checks, whatever address it dialled: an
address from the registry proves nothing until its peer shows a cluster certificate).

Which role may call what (:data:`RPC_ROLES`; anything else is PERMISSION_DENIED):

    DecodeWorker/Generate, Abort    gateway
    DecodeWorker/Stats              gateway, operator
    PrefillWorker/Prefill, Abort    decode, colocated
    PrefillWorker/Stats             gateway, operator, decode, colocated
    KV receiver (a connection)      prefill, colocated senders; a sender admits decode and
                                    colocated receivers only

Files: ``tls_ca_file`` (the cluster CA certificate), ``tls_cert_file`` / ``tls_key_file``
(this service's certificate and key, PEM). They are re-read when they change (checked at
most once a second): new connections use the new certificate, open ones keep theirs, so a
rotation needs no restart (docs/security.md). A reload that fails (a half-written file, a
certificate the CA did not sign, a key that does not match) keeps the previous material and
logs an error.

Registry entries are signed with the worker's key (:meth:`ClusterTls.sign`) and carry its
certificate; :meth:`ClusterTls.check_entry` accepts an entry only when the certificate is
the cluster CA's, its role is the entry's role, the signature covers the entry and its expiry
has not passed: a Redis writer without a cluster key cannot add or redirect a worker.

Minting (``pdserve up``, ``pdserve certs``, the tests): :func:`mint_ca`, :func:`mint_cert`,
:func:`write_cluster_files`. EC P-256 keys (fast to make and to handshake with).
"""
from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
import datetime as dt
import functools
import hashlib
import inspect
import ipaddress
import json
import logging
import os
from pathlib import Path
import secrets
import ssl
import threading
import time

import grpc

logger = logging.getLogger(__name__)

ROLES = ("gateway", "prefill", "decode", "colocated", "operator", "redis")
CLUSTER_NAME = "pdserve.internal"
ROLE_URI = "urn:pdserve:role:"
RELOAD_CHECK_S = 1.0

_DECODE = "/pdserve.v1.DecodeWorker/"
_PREFILL = "/pdserve.v1.PrefillWorker/"
RPC_ROLES: dict[str, tuple[str, ...]] = {
    _DECODE + "Generate": ("gateway",),
    _DECODE + "Abort": ("gateway",),
    _DECODE + "Stats": ("gateway", "operator"),
    _PREFILL + "Prefill": ("decode", "colocated"),
    _PREFILL + "Abort": ("decode", "colocated"),
    _PREFILL + "Stats": ("gateway", "operator", "decode", "colocated"),
}
# any cluster certificate: probes and service discovery
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
KV_SENDER_ROLES = ("prefill", "colocated")
KV_RECEIVER_ROLES = ("decode", "colocated")


class TlsError(ValueError):
    """Unusable certificate material, or a peer / entry that is not a cluster member's."""


# ------------------------------------------------------------------------------ minting
def _x509():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _pem_key(key) -> bytes:
    _, _, serialization, _, _, _ = _x509()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def mint_ca(name: str = "pdserve cluster CA", days: int = 365) -> tuple[bytes, bytes]:
    """A new self-signed CA: ``(certificate PEM, key PEM)``."""
    x509, hashes, serialization, ec, _, NameOID = _x509()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def mint_cert(ca_cert_pem: bytes, ca_key_pem: bytes, role: str, name: str = "",
              hosts: Iterable[str] = (), days: int = 90) -> tuple[bytes, bytes]:
    """A service certificate of ``role`` signed by the CA: ``(certificate PEM, key PEM)``.
    ``hosts``: extra DNS names / IP addresses besides :data:`CLUSTER_NAME`."""
    if role not in ROLES:
        raise TlsError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    x509, hashes, serialization, ec, EKU, NameOID = _x509()
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list = [x509.DNSName(CLUSTER_NAME), x509.UniformResourceIdentifier(ROLE_URI + role)]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([
                x509.NameAttribute(NameOID.COMMON_NAME, name or f"pdserve-{role}"),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@dataclass(frozen=True)
class ClusterFiles:
    """What :func:`write_cluster_files` wrote (paths)."""

    directory: str
    ca_file: str
    redis_password_file: str

    def cert(self, role: str) -> str:
        return os.path.join(self.directory, f"{role}.crt")

    def key(self, role: str) -> str:
        return os.path.join(self.directory, f"{role}.key")

    def flags(self, role: str) -> list[str]:
        """The flags that give a service of ``role`` its identity and the Redis password."""
        return ["--tls-ca-file", self.ca_file, "--tls-cert-file", self.cert(role),
                "--tls-key-file", self.key(role),
                "--redis-password-file", self.redis_password_file]


def _write(path: str, data: bytes, mode: int = 0o600) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: a watcher never reads half a file


def write_cluster_files(directory: str, roles: Iterable[str] = ROLES,
                        hosts: Iterable[str] = ("127.0.0.1", "localhost"),
                        ca: tuple[bytes, bytes] | None = None,
                        redis_password: str | None = None) -> ClusterFiles:
    """A throw-away cluster identity in ``directory`` (made 0700): ``ca.crt`` (and
    ``ca.key``), ``<role>.crt`` / ``<role>.key`` per role, ``redis-password``."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca_cert, ca_key = ca or mint_ca()
    _write(os.path.join(directory, "ca.crt"), ca_cert, 0o644)
    _write(os.path.join(directory, "ca.key"), ca_key)
    hosts = tuple(hosts)
    for role in roles:
        cert, key = mint_cert(ca_cert, ca_key, role, hosts=hosts)
        _write(os.path.join(directory, f"{role}.crt"), cert, 0o644)
        _write(os.path.join(directory, f"{role}.key"), key)
    pw = os.path.join(directory, "redis-password")
    _write(pw, (redis_password or secrets.token_urlsafe(24)).encode())
    return ClusterFiles(directory, os.path.join(directory, "ca.crt"), pw)


def read_secret_file(path: str, what: str) -> str:
    """A secret kept in a file (a Kubernetes Secret, a compose secret): its first line."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror}") from None
    value = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not value:
        raise ValueError(f"{what} {path!r} is empty")
    return value


# ------------------------------------------------------------------------- certificates
@functools.lru_cache(maxsize=256)
def _load_cert(pem: bytes):
    from cryptography import x509
    return x509.load_pem_x509_certificate(pem)


@functools.lru_cache(maxsize=16)
def _cas(pem: bytes) -> tuple:
    """Every certificate of a CA file (one CA, or old and new during a rotation)."""
    from cryptography import x509
    return tuple(x509.load_pem_x509_certificates(pem))


def _issued_by_one(cert, ca_pem: bytes) -> bool:
    for ca in _cas(ca_pem):
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except Exception:  # noqa: BLE001 - ValueError, TypeError or InvalidSignature
            continue
    return False


def cert_role(cert) -> str | None:
    """The role a certificate carries (its ``urn:pdserve:role:`` URI SAN), or None."""
    from cryptography import x509
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(ROLE_URI) and uri[len(ROLE_URI):] in ROLES:
            return uri[len(ROLE_URI):]
    return None


@functools.lru_cache(maxsize=256)
def pem_role(pem: bytes) -> str | None:
    """The role of a PEM certificate that TLS already verified (gRPC's auth context)."""
    try:
        return cert_role(_load_cert(pem))
    except ValueError:
        return None


def der_role(der: bytes) -> str | None:
    from cryptography import x509
    try:
        return cert_role(x509.load_der_x509_certificate(der))
    except ValueError:
        return None


@dataclass(frozen=True)
class _Material:
    ca: bytes
    cert: bytes
    key: bytes
    role: str
    generation: int


class ClusterTls:
    """This service's identity and the cluster CA, from files, reloaded when they change."""

    def __init__(self, ca_file: str, cert_file: str, key_file: str, *,
                 check_s: float = RELOAD_CHECK_S):
        self.files = (ca_file, cert_file, key_file)
        self.check_s = check_s
        self._lock = threading.Lock()  # gRPC calls the fetcher from its own threads
        self._stamp: tuple = ()
        self._checked = 0.0
        self._m = self._read(0)  # raises TlsError: a service does not start without it
        self._stamp = self._stat()
        self._contexts: dict[str, tuple[int, ssl.SSLContext]] = {}

    # ------------------------------------------------------------------ files
    def _stat(self) -> tuple:
        out = []
        for f in self.files:
            try:
                st = os.stat(f)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def _read(self, generation: int) -> _Material:
        from cryptography.hazmat.primitives import serialization
        names = ("tls_ca_file", "tls_cert_file", "tls_key_file")
        data = []
        for name, path in zip(names, self.files):
            try:
                data.append(Path(path).read_bytes())
            except OSError as e:
                raise TlsError(f"cannot read {name} {path!r}: {e.strerror}") from None
        ca_pem, cert_pem, key_pem = data
        try:
            cert = _load_cert(cert_pem)
            _cas(ca_pem)
            key = serialization.load_pem_private_key(key_pem, None)
        except ValueError as e:
            raise TlsError(f"unreadable certificate or key: {e}") from None
        if not _issued_by_one(cert, ca_pem):
            raise TlsError(f"{self.files[1]} is not signed by the CA in {self.files[0]}")
        if key.public_key().public_numbers() != cert.public_key().public_numbers():
            raise TlsError(f"{self.files[2]} is not the key of {self.files[1]}")
        role = cert_role(cert)
        if role is None:
            raise TlsError(f"{self.files[1]} carries no pdserve role ({ROLE_URI}<role>)")
        return _Material(ca_pem, cert_pem, key_pem, role, generation)

    def material(self) -> _Material:
        """The current material; re-read (at most every ``check_s``) when a file changed."""
        now = time.monotonic()
        if now - self._checked < self.check_s:
            return self._m
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp != self._stamp:
                try:
                    m = self._read(self._m.generation + 1)
                except TlsError as e:
                    logger.error("certificate reload failed, keeping the current one: %s", e)
                else:
                    if (m.ca, m.cert, m.key) != (self._m.ca, self._m.cert, self._m.key):
                        logger.info("certificates reloaded from %s", ", ".join(self.files))
                        self._m = m
                    self._stamp = stamp
            return self._m

    @property
    def role(self) -> str:
        return self.material().role

    # ------------------------------------------------------------------ gRPC
    def server_credentials(self) -> grpc.ServerCredentials:
        """mTLS server credentials that pick up rotated files for each new connection."""
        m = self.material()
        served = [m.generation]

        def config(mm: _Material):
            return grpc.ssl_server_certificate_configuration([(mm.key, mm.cert)],
                                                            root_certificates=mm.ca)

        def fetch():
            mm = self.material()
            if mm.generation == served[0]:
                return None
            served[0] = mm.generation
            return config(mm)

        return grpc.dynamic_ssl_server_credentials(config(m), fetch,
                                                   require_client_authentication=True)

    def channel_credentials(self) -> tuple[grpc.ChannelCredentials, int]:
        """Client credentials of the current material and its generation (a channel made
        with an older generation should be replaced)."""
        m = self.material()
        return (grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key,
                                             certificate_chain=m.cert), m.generation)

    # ------------------------------------------------------------------ KV (ssl module)
    def _context(self, side: str) -> ssl.SSLContext:
        m = self.material()
        cached = self._contexts.get(side)
        if cached is not None and cached[0] == m.generation:
            return cached[1]
        server = side == "server"
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=m.ca.decode())
        _load_chain(ctx, m)
        self._contexts[side] = (m.generation, ctx)
        return ctx

    def server_context(self) -> ssl.SSLContext:
        return self._context("server")

    def client_context(self) -> ssl.SSLContext:
        return self._context("client")

    server_hostname = CLUSTER_NAME

    def check_peer(self, der: bytes | None, roles: tuple[str, ...], what: str) -> str:
        """The role of a TLS peer's (already verified) certificate, when it is one of
        ``roles``; TlsError otherwise."""
        role = der_role(der) if der else None
        if role not in roles:
            raise TlsError(f"{what} presented a {role or 'role-less'} certificate; "
                           f"only {', '.join(roles)} may connect")
        return role

    def check_sender(self, der: bytes | None) -> None:
        self.check_peer(der, KV_SENDER_ROLES, "KV sender")

    def check_receiver(self, der: bytes | None) -> None:
        self.check_peer(der, KV_RECEIVER_ROLES, "KV receiver")

    # ------------------------------------------------------------------ signed entries
    def cert_pem(self) -> str:
        return self.material().cert.decode()

    def sign(self, payload: bytes) -> tuple[str, str]:
        """``(certificate PEM, base64 signature)`` of ``payload`` with this service's key."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        m = self.material()
        key = _private_key(m.key)
        sig = key.sign(payload, ec.ECDSA(hashes.SHA256()))
        return m.cert.decode(), base64.b64encode(sig).decode()

    def check_entry(self, cert_pem: str, payload: bytes, sig_b64: str, role: str,
                    expires_ms: int) -> None:
        """TlsError unless ``payload`` was signed, before ``expires_ms`` (not yet past), by
        a cluster certificate of ``role``."""
        if not cert_pem or not sig_b64:
            raise TlsError("unsigned entry")
        now_ms = time.time() * 1000
        if expires_ms <= now_ms:
            raise TlsError("expired entry")
        cert = self._cluster_cert(cert_pem.encode())
        if cert_role(cert) != role:
            raise TlsError(f"entry of role {role} signed by a {cert_role(cert)} certificate")
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        try:
            cert.public_key().verify(base64.b64decode(sig_b64), payload,
                                     ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError, TypeError):
            raise TlsError("bad signature") from None

    def _cluster_cert(self, pem: bytes):
        ca = self.material().ca
        return _verified_cert(ca, pem)


def _load_chain(ctx: ssl.SSLContext, m: _Material) -> None:
    """The material's certificate and key into ``ctx`` (the ssl module reads files only:
    a private temporary file, removed at once, so what is loaded is what was checked)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as d:
        path = os.path.join(d, "chain.pem")
        _write(path, m.cert + b"\n" + m.key)
        ctx.load_cert_chain(path)


@functools.lru_cache(maxsize=64)
def _private_key(pem: bytes):
    from cryptography.hazmat.primitives import serialization
    return serialization.load_pem_private_key(pem, None)


@functools.lru_cache(maxsize=1024)
def _verified_cert(ca_pem: bytes, pem: bytes):
    """``pem``'s certificate when the CA signed it and it is valid now (cached per CA: a
    rotated CA re-checks everything)."""
    try:
        cert = _load_cert(pem)
    except ValueError:
        raise TlsError("unreadable certificate") from None
    if not _issued_by_one(cert, ca_pem):
        raise TlsError("certificate not signed by the cluster CA")
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise TlsError("certificate not valid now")
    return cert


def entry_payload(fields: dict[str, str]) -> bytes:
    """The bytes a registry entry's signature covers: every field but the signature."""
    return json.dumps({k: v for k, v in fields.items() if k != "sig"}, sort_keys=True,
                      separators=(",", ":")).encode()


def client_port_credentials(cert_file: str, key_file: str, ca_file: str = ""
                            ) -> grpc.ServerCredentials:
    """The gateway's client port: TLS with its certificate (and, with ``ca_file``, client
    certificates that CA signed), re-read for new connections when the files change."""
    files = [f for f in (cert_file, key_file, ca_file) if f]

    def read():
        try:
            data = [Path(f).read_bytes() for f in files]
        except OSError as e:
            raise TlsError(f"cannot read the client port's certificate files: {e}") from None
        cert, key = data[0], data[1]
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=data[2] if ca_file else None)

    def stamp():
        return tuple(os.stat(f).st_mtime_ns if os.path.exists(f) else 0 for f in files)

    state = {"stamp": stamp(), "checked": time.monotonic()}
    initial = read()

    def fetch():
        now = time.monotonic()
        if now - state["checked"] < RELOAD_CHECK_S:
            return None
        state["checked"] = now
        st = stamp()
        if st == state["stamp"]:
            return None
        try:
            config = read()
        except TlsError as e:
            logger.error("client port certificate reload failed: %s", e)
            return None
        state["stamp"] = st
        logger.info("client port certificate reloaded")
        return config

    return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                               require_client_authentication=bool(ca_file))


def cluster_tls(settings) -> ClusterTls | None:
    """The service's :class:`ClusterTls` from its settings (None without certificates)."""
    if not settings.tls_cert_file:
        if settings.insecure:
            logger.warning("--insecure: no TLS between services, no role or membership "
                           "checks, registry entries unsigned; anyone who reaches this "
                           "service's ports or its Redis can use them")
        return None
    return ClusterTls(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)


# ------------------------------------------------------------------------ per-RPC roles
class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Admits each RPC only from the roles :data:`RPC_ROLES` lists for it (health and
    reflection: any cluster certificate; an unlisted method: nobody)."""

    def __init__(self, policy: dict[str, tuple[str, ...]] | None = None,
                 on_reject: Callable[[str, str], None] | None = None):
        self.policy = RPC_ROLES if policy is None else policy
        self._on_reject = on_reject

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        return _checked(handler, method, self.policy.get(method, ()), self._on_reject)


def peer_role(context) -> str | None:
    pems = context.auth_context().get("x509_pem_cert") or ()
    return pem_role(bytes(pems[0])) if pems else None


def _checked(handler: grpc.RpcMethodHandler, method: str, roles: tuple[str, ...],
             on_reject) -> grpc.RpcMethodHandler:
    """``handler`` behind a check of the caller's role."""
    def why(context) -> str | None:
        role = peer_role(context)
        if role in roles:
            return None
        msg = (f"{method} is not open to a {role or 'role-less'} certificate"
               + (f" (only {', '.join(roles)})" if roles else ""))
        logger.warning("refused %s from %s: %s", method, context.peer(), msg)
        if on_reject is not None:
            on_reject(method, role or "")
        return msg

    code = grpc.StatusCode.PERMISSION_DENIED
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        inner = handler.unary_stream

        async def stream(request, context):
            if (msg := why(context)) is not None:
                await context.abort(code, msg)
            res = inner(request, context)
            if inspect.isasyncgen(res):
                async for item in res:
                    yield item
            else:  # a coroutine that writes its responses with context.write
                await res
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.unary_unary is not None:
        inner_u = handler.unary_unary

        async def unary(request, context):
            if (msg := why(context)) is not None:
                await context.abort(code, msg)
            return await inner_u(request, context)
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    # streaming requests: no pdserve RPC has one; refuse rather than pass unchecked
    async def refuse(request_iterator, context):
        await context.abort(code, f"{method}: streaming requests are not served here")
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse, **kw)


def api_key_hash(key: str) -> str:
    """How an API key may be stored: ``sha256:<hex>`` (``pdserve hash-key``)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()
