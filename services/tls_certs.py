"""Cluster certificates: minting a CA and role certificates (``pdserve up``, ``pdserve
certs``, the tests) and reading a certificate's role. EC P-256 keys (fast to make and to
handshake with). Each certificate carries its role as the URI SAN ``urn:pdserve:role:<role>``
(one of :data:`ROLES`) and the cluster name :data:`CLUSTER_NAME`. Split out of
:mod:`services.tls`, which re-exports every name here."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
import datetime as dt
import functools
import ipaddress
import os
import secrets

ROLES = ("gateway", "prefill", "decode", "colocated", "operator", "redis")
CLUSTER_NAME = "pdserve.internal"
ROLE_URI = "urn:pdserve:role:"


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
    from pdcore.files import read_small_text
    text = read_small_text(path, what)  # a regular file, small, UTF-8 (else ValueError)
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
