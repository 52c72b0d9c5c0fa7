"""``host:port`` text, one rule for every address setting and flag (--decode-addrs,
--prefill-addrs, --peer-addrs, the clients' --address): an IPv6 host is written in brackets,
``[::1]:50051``; a bare one with a port (``::1:50051``) is ambiguous and refused, naming the
bracketed form."""
from __future__ import annotations

import ipaddress


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text.partition("%")[0])  # a zone (fe80::1%eth0) is allowed
        return True
    except ValueError:
        return False


def host_problem(host: str) -> str | None:
    """Why ``host`` (no brackets, no port) is neither an IP address nor a host name (None:
    it is one): empty labels (``a..b``), labels over 63 characters or starting or ending
    with '-', characters a name cannot hold, or dotted numbers that are no IPv4 address
    (``999.1.1.1``). Underscores are allowed (container and service names use them)."""
    if _is_ipv6(host):
        return None
    try:
        ipaddress.IPv4Address(host)
        return None
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host  # a fully qualified name's root dot
    if not name or len(name) > 253:
        return "a host name has 1 to 253 characters"
    labels = name.split(".")
    for label in labels:
        if not label:
            return "a host name has no empty part between dots"
        if len(label) > 63:
            return "each dot-separated part of a host name has at most 63 characters"
        if label[0] == "-" or label[-1] == "-":
            return "a part of a host name neither starts nor ends with '-'"
        if not all(c.isascii() and (c.isalnum() or c in "-_") for c in label):
            return "a host name holds letters, digits, '-' and '_' between dots"
    if all(label.isdigit() for label in labels):
        return "dotted numbers that are not an IPv4 address"
    return None


def split_host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host without brackets, port in 1..65535); ValueError
    saying what is wrong (the caller adds which setting)."""
    if not isinstance(text, str) or not text or any(c.isspace() for c in text):
        raise ValueError(f"expected host:port, got {text!r}")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not _is_ipv6(host):
            raise ValueError(f"expected [IPv6 address]:port, got {text!r}")
        if not rest.startswith(":"):
            raise ValueError(f"expected host:port, got {text!r} (no port)")
        port = rest[1:]
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host or _is_ipv6(text):  # an IPv6 address without brackets
            if sep and port.isdigit() and _is_ipv6(host):
                hint = f"write it [{host}]:{port}"
            elif _is_ipv6(text):
                hint = f"write it [{text}]:PORT"
            else:
                hint = "e.g. [::1]:50051"
            raise ValueError(f"expected host:port with an IPv6 host in brackets, got "
                             f"{text!r}: {hint}")
        if not sep or not host:
            raise ValueError(f"expected host:port, got {text!r}")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"expected host:port with a port in 1..65535, got {text!r}")
    problem = host_problem(host)
    if problem:
        raise ValueError(f"{host!r} in {text!r} is not a host: {problem}")
    return host, int(port)


def bare_host(host: str) -> str:
    """A host without the brackets of an IPv6 address (what sockets take)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def join_host_port(host: str, port: int) -> str:
    """(host, port) -> ``host:port``, an IPv6 host in brackets (what gRPC and peers dial)."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
