"""What is wrong with a Redis URL, found when the settings are checked (redis-py would
find it only when the service connects, after its engine loaded)."""
from __future__ import annotations

from pdcore.config_tree import redact_url


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a redis://, rediss:// or unix:// URL, else None: what redis-py
    would refuse when the service connects, and what it would silently drop (a database
    that is not a number: the service would use database 0)."""
    from urllib.parse import parse_qs, urlsplit
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as e:  # its text may quote a password (redis://u:pa/ss@h): not shown
        what = "port out of range 0-65535" if "range" in str(e) else (
            "invalid IPv6 host" if "IPv6" in str(e) else "port is not a number")
        return f"{what} in {redact_url(url)!r}"
    query = parse_qs(u.query)
    if u.scheme == "unix":
        if not u.path:
            return "unix:// needs the socket's path (unix:///run/redis.sock)"
        db = query.get("db", ["0"])[0]
    else:
        if not u.hostname:
            return f"no host in {redact_url(url)!r}"
        db = u.path.lstrip("/") or query.get("db", ["0"])[0]
    if not db.isdigit():
        return f"database {db!r} is not a number"
    for name in ("socket_timeout", "socket_connect_timeout", "health_check_interval"):
        for v in query.get(name, []):
            try:
                float(v)
            except ValueError:
                return f"{name}={v!r} is not a number"
    return None
