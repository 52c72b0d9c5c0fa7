"""What Python's ssl module itself moves over loopback TCP on this machine, with no pdserve
code in the way: the ceiling of any tcp KV backend built on it (issue 23's TLS target).

Two processes: a sender writes ``--mib`` MiB ``--rounds`` times in 4 MiB ``sendall`` calls,
a receiver ``recv_into`` s them into one buffer; GB/s is over the receiver's time, and the
receiver's CPU seconds per GB (user + system) show where it goes. Cases: plaintext, TLS 1.3
(OpenSSL picks AES-256-GCM; Python cannot set TLS 1.3 suites), and TLS 1.2 with AES-128-GCM,
AES-256-GCM and ChaCha20-Poly1305; and ``aead_4mib``: no TLS record layer, each 4 MiB piece
sealed whole with AES-128-GCM (``cryptography``'s ``encrypt_into`` / ``decrypt_into``, a
counter nonce, the key shared beforehand), what a data channel keyed over a TLS control
connection would pay. ``openssl speed`` of the ciphers on 16 KiB records (one core) is
recorded beside them: the cost of the cipher alone.

    python3 -m bench.tls_ceiling_cpu --set cpu-2core
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import ssl
import subprocess
import tempfile
import time

from pdserve.benchlib import harness

CASES = {
    "plain": None,
    "tls13": ("", None),
    "tls12_aes128gcm": ("ECDHE-ECDSA-AES128-GCM-SHA256", ssl.TLSVersion.TLSv1_2),
    "tls12_aes256gcm": ("ECDHE-ECDSA-AES256-GCM-SHA384", ssl.TLSVersion.TLSv1_2),
    "tls12_chacha20": ("ECDHE-ECDSA-CHACHA20-POLY1305", ssl.TLSVersion.TLSv1_2),
    "aead_4mib": "aead",
}
PIECE = 4 << 20
TAG = 16  # AES-GCM's tag, after each sealed piece
FIGURES = [harness.Figure(f"{c}: loopback GB/s", "GB/s", ("results", c, "gbps"))
           for c in CASES]


def _contexts(case, certs: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    srv = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    srv.load_cert_chain(os.path.join(certs, "decode.crt"), os.path.join(certs, "decode.key"))
    cli = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    cli.load_verify_locations(os.path.join(certs, "ca.crt"))
    ciphers, version = case
    for ctx in (srv, cli):
        if version is not None:
            ctx.maximum_version = version
            ctx.set_ciphers(ciphers)
    return srv, cli


def _nonce(n: int) -> bytes:
    return n.to_bytes(12, "big")


def one_case(case, certs: str, nbytes: int, rounds: int) -> dict:
    if case == "aead":
        return _aead_case(nbytes, rounds)
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    buf = bytearray(nbytes)
    pid = os.fork()
    if pid == 0:  # the sender
        try:
            s = socket.create_connection(("127.0.0.1", port))
            if case is not None:
                s = _contexts(case, certs)[1].wrap_socket(s, server_hostname="127.0.0.1")
            mv = memoryview(buf)
            for _ in range(rounds):
                for i in range(0, nbytes, PIECE):
                    s.sendall(mv[i:i + PIECE])
            s.recv(1)
        finally:
            os._exit(0)
    conn, _ = ls.accept()
    cipher = None
    if case is not None:
        conn = _contexts(case, certs)[0].wrap_socket(conn, server_side=True)
        cipher = conn.cipher()[0]
    mv = memoryview(buf)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(rounds):
        pos = 0
        while pos < nbytes:
            pos += conn.recv_into(mv[pos:])
    return _finish(conn, ls, pid, rounds * nbytes, r0, t0, cipher)


def _finish(conn, ls, pid: int, nbytes: int, r0, t0: float, cipher) -> dict:
    """The receiver's side after its last byte: release the sender, close, the figures."""
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    conn.send(b"x")
    os.waitpid(pid, 0)
    conn.close()
    ls.close()
    gb = nbytes / 1e9
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return {"cipher": cipher, "gbps": round(gb / dt, 3),
            "receiver_cpu_s_per_gb": round(cpu / gb, 3)}


def _aead_case(nbytes: int, rounds: int) -> dict:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    ls = socket.create_server(("127.0.0.1", 0))
    port, key = ls.getsockname()[1], AESGCM.generate_key(128)
    buf = bytearray(nbytes)
    pid = os.fork()
    if pid == 0:  # the sender: seal each piece into one buffer, send it
        try:
            s, a = socket.create_connection(("127.0.0.1", port)), AESGCM(key)
            out, mv, n = bytearray(PIECE + TAG), memoryview(buf), 0
            for _ in range(rounds):
                for i in range(0, nbytes, PIECE):
                    a.encrypt_into(_nonce(n), mv[i:i + PIECE], None, out)
                    s.sendall(out)
                    n += 1
            s.recv(1)
        finally:
            os._exit(0)
    conn, _ = ls.accept()
    a, mv = AESGCM(key), memoryview(buf)
    sealed = bytearray(PIECE + TAG)
    smv, n = memoryview(sealed), 0
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(rounds):
        for i in range(0, nbytes, PIECE):
            pos = 0
            while pos < len(sealed):
                pos += conn.recv_into(smv[pos:])
            a.decrypt_into(_nonce(n), sealed, None, mv[i:i + PIECE])  # InvalidTag: tampered
            n += 1
    return _finish(conn, ls, pid, rounds * nbytes, r0, t0, "AES-128-GCM, 4 MiB records")


def cipher_speed() -> dict:
    """``openssl speed -evp`` on 16 KiB blocks, one core: GB/s per cipher (None: no openssl)."""
    out = {}
    for name in ("aes-128-gcm", "aes-256-gcm", "chacha20-poly1305"):
        try:
            text = subprocess.run(["openssl", "speed", "-seconds", "2", "-bytes", "16384",
                                   "-evp", name], capture_output=True, text=True,
                                  timeout=60).stdout
            out[name] = round(float(text.strip().splitlines()[-1].split()[-1].rstrip("k"))
                              * 1000 / 1e9, 3)
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python3 -m bench.tls_ceiling_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs of each case; the median")
    harness.add_output_args(p, "tls_ceiling_cpu")
    args = p.parse_args(argv)
    rec = harness.Recorder.start("tls_ceiling_cpu", args, argv=argv, about=__doc__,
                                 figures=FIGURES)
    from services.tls_certs import write_cluster_files
    certs = write_cluster_files(tempfile.mkdtemp(prefix="tls-ceiling-")).directory
    results = {}
    for _ in range(args.repeats):  # the cases interleaved, so a load change hits them all
        for name, case in CASES.items():
            r = one_case(case, certs, args.mib << 20, args.rounds)
            results.setdefault(name, []).append(r)
            print(name, r, flush=True)
    rec["results"] = {}
    for name, runs in results.items():
        runs.sort(key=lambda r: r["gbps"])
        rec["results"][name] = {**runs[len(runs) // 2], "runs_gbps": [r["gbps"] for r in runs]}
    plain = rec["results"]["plain"]["gbps"]
    rec["ratio_to_plain"] = {n: round(r["gbps"] / plain, 3) for n, r in rec["results"].items()}
    rec["openssl_speed_gbps_one_core"] = cipher_speed()
    print("ratio to plaintext:", rec["ratio_to_plain"])
    print("openssl speed (GB/s, one core):", rec["openssl_speed_gbps_one_core"])
    print("wrote", rec.save())
    return rec.doc


if __name__ == "__main__":
    main()
