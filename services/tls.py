"""Cluster identity: mutual TLS between services, role-carrying certificates, signed entries.

Every internal hop (gateway -> workers, decode -> prefill, a prefill worker's KV sender ->
a decode worker's receiver) runs over TLS where **both** sides present a certificate that
the cluster CA signed. Each certificate carries its service's role (a URI SAN
``urn:pdserve:role:<role>``, one of :data:`ROLES`) and the cluster name
:data:`CLUSTER_NAME` (a DNS SAN every client checks, whatever address it dialled: an
address from the registry proves nothing until its peer shows a cluster certificate).

Which role may call what (:data:`RPC_ROLES`; anything else is PERMISSION_DENIED):

    DecodeWorker/Generate, GenerateMany, Abort    gateway
    DecodeWorker/Stats                            gateway, operator
    PrefillWorker/Prefill, Abort                  decode, colocated
    PrefillWorker/Stats                           gateway, operator, decode, colocated
    KV receiver (a connection)                    prefill, colocated senders; a sender
                                                  admits decode and colocated receivers only

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

Modules: :mod:`services.tls_certs` (minting, reading a certificate's role),
:mod:`services.tls_roles` (the per-RPC role interceptor), this one (a service's identity:
gRPC and KV credentials, reload, signed entries, the client port's credentials); every name
of the first two is re-exported here.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
import datetime as dt
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
import ssl
import threading
import time

import grpc

from services.tls_certs import (  # noqa: F401 - re-exported: services.tls is the API
    CLUSTER_NAME, ROLE_URI, ROLES, ClusterFiles, TlsError, _cas, _issued_by_one, _load_cert,
    _write, cert_role, der_role, mint_ca, mint_cert, pem_role, read_secret_file,
    write_cluster_files)
from services.tls_roles import (  # noqa: F401 - re-exported
    OPEN_PREFIXES, RPC_ROLES, RoleInterceptor, peer_role)

logger = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0

KV_SENDER_ROLES = ("prefill", "colocated")
KV_RECEIVER_ROLES = ("decode", "colocated")


def files_stamp(files) -> tuple:
    """What changes when any of ``files`` is rewritten or replaced (mtime, size, inode; None
    for a missing one): certificate reloads compare it."""
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


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
        return files_stamp(self.files)

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


def check_key_pair(cert_file: str, key_file: str, ca_file: str = "",
                   prefix: str = "client_tls") -> None:
    """TlsError (a ValueError, one line) unless ``cert_file`` holds a PEM certificate,
    ``key_file`` its unencrypted PEM private key and ``ca_file`` (when given) PEM
    certificates: what a TLS port (the client port, /metrics) loads when it starts.
    ``prefix`` names the settings: ``<prefix>_cert_file`` ..."""
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    names = {"cert": f"{prefix}_cert_file", "key": f"{prefix}_key_file",
             "ca": f"{prefix}_ca_file"}
    paths = {"cert": cert_file, "key": key_file, "ca": ca_file}
    data = {}
    for which, path in paths.items():
        if not path:
            continue
        try:
            data[which] = Path(path).read_bytes()
        except OSError as e:
            raise TlsError(f"cannot read {names[which]} {path!r}: {e.strerror}") from None
    if "key" not in data:
        raise TlsError(f"{names['cert']} needs {names['key']}")
    for which in ("cert", "ca"):
        if which in data:
            try:
                certs = x509.load_pem_x509_certificates(data[which])
            except ValueError:
                certs = []
            if not certs:
                raise TlsError(f"{names[which]} {paths[which]!r} holds no PEM certificate")
            if which == "cert":
                cert = certs[0]
    try:
        key = serialization.load_pem_private_key(data["key"], None)
    except TypeError:  # encrypted: nothing here could give its passphrase
        raise TlsError(f"{names['key']} {key_file!r} is encrypted: a service needs an "
                       f"unencrypted key") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsError(f"{names['key']} {key_file!r} holds no PEM private key") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if (key.public_key().public_bytes(serialization.Encoding.DER, spki)
            != cert.public_key().public_bytes(serialization.Encoding.DER, spki)):
        raise TlsError(f"{names['key']} {key_file!r} is not the key of {names['cert']} "
                       f"{cert_file!r}")


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


def api_key_hash(key: str) -> str:
    """How an API key may be stored: ``sha256:<hex>`` (``pdserve hash-key``)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()
