"""pdcore/hostport.py: one rule for every host:port and host setting."""
from __future__ import annotations

import pytest

from pdcore.hostport import host_problem, split_host_port


@pytest.mark.parametrize("host", [
    "localhost", "redis", "decode_1", "my_worker.local", "a-b.example.com.", "10.0.0.1",
    "::1", "fe80::1%eth0", "pdserve-decode-0.pdserve-decode.default.svc.cluster.local",
    "x" * 63 + ".io", "1a.2b"])
def test_names_and_addresses_that_are_hosts(host):
    assert host_problem(host) is None


@pytest.mark.parametrize("host, problem", [
    ("a..b", "no empty part"), (".a", "no empty part"), ("-a", "starts nor ends with '-'"),
    ("a-", "starts nor ends with '-'"), ("a b", "letters, digits"), ("é.com", "letters"),
    ("x" * 64, "at most 63"), ("999.1.1.1", "not an IPv4"), ("1.2.3", "not an IPv4"),
    ("", "1 to 253"), ("a." * 130, "1 to 253")])
def test_text_that_names_no_host(host, problem):
    assert problem in host_problem(host)


def test_split_host_port_checks_the_host():
    assert split_host_port("decode-0.svc:50061") == ("decode-0.svc", 50061)
    assert split_host_port("[::1]:1") == ("::1", 1)
    with pytest.raises(ValueError, match="'a..b' in 'a..b:1' is not a host"):
        split_host_port("a..b:1")
