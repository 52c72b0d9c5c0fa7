"""A command that cannot start says why in one line, without a traceback, and exits 2 for a bad
value given to it (a flag, variable or file; a host that is not this machine's) or 1 for
what the machine refused (a port another process holds): services/startup.py. Each test runs
the real CLI as a process."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GATEWAY = ["gateway", "--model", "dummy:tiny", "--decode-addrs", "127.0.0.1:1",
           "--log-format", "text", "--port", "0", "--http-port", "0"]
WORKER = ["--model", "dummy:tiny", "--log-format", "text", "--port", "0"]
NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this machine


def cli(*argv: str, env: dict | None = None, timeout: float = 60,
        code: str | None = None) -> subprocess.CompletedProcess:
    """``pdserve <argv>`` as a user runs it (``code``: a ``python -c`` program instead)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    environ.update(env or {})
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "pdserve.cli"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=environ, preexec_fn=default_sigint)


def default_sigint() -> None:
    """In the child: Ctrl-C as a terminal delivers it. A suite started in the background of
    a shell without job control inherits SIGINT ignored, and so would every service here
    (Python leaves an ignored SIGINT ignored): the Ctrl-C tests would test nothing."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_one_error(r: subprocess.CompletedProcess, status: int, *parts: str) -> str:
    """Exit ``status``; no traceback; stderr ends with the one error line, which holds every
    one of ``parts`` (the service's log lines may come before it)."""
    err = r.stderr
    assert r.returncode == status, (r.returncode, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = err.strip().splitlines()
    assert lines, "nothing on stderr"
    last = lines[-1]
    assert last.startswith(("error: ", "pdserve ")) and "error: " in last, last
    # log lines (timestamped) aside, the error line is the only one
    assert sum("error: " in ln and not ln[:4].isdigit() for ln in lines) == 1, err
    for p in parts:
        assert p in last, (p, last)
    return last


@pytest.fixture
def held_port():
    """A port this test holds (listening): anything else binding it finds it in use."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Two certificates and their keys (the first's key is not the second's), a non-PEM
    file, an encrypted key."""
    from cryptography.hazmat.primitives import serialization
    from services.tls import mint_ca, mint_cert
    d = tmp_path_factory.mktemp("certs")
    ca, ca_key = mint_ca()
    files = {}
    for name in ("a", "b"):
        cert, key = mint_cert(ca, ca_key, "gateway", hosts=["127.0.0.1"])
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        files[name] = (str(d / f"{name}.crt"), str(d / f"{name}.key"))
    (d / "ca.crt").write_bytes(ca)
    (d / "junk.pem").write_text("not a certificate\n")
    enc = serialization.load_pem_private_key(ca_key, None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"))
    (d / "enc.key").write_bytes(enc)
    files.update(ca=str(d / "ca.crt"), junk=str(d / "junk.pem"), enc=str(d / "enc.key"))
    return files


# ------------------------------------------------------------------ 1. the gateway
@pytest.mark.parametrize("flag, what", [("--port", "the gRPC port"),
                                        ("--http-port", "the HTTP port"),
                                        ("--metrics-port", "the metrics port")])
def test_gateway_port_in_use_exits_1_naming_it(held_port, flag, what):
    argv = [*GATEWAY, flag, str(held_port)]
    assert_one_error(cli(*argv), 1, f"127.0.0.1:{held_port}", what, flag,
                     "address already in use")


def test_gateway_host_that_is_not_this_machines_exits_2():
    assert_one_error(cli(*GATEWAY, "--host", NOT_HERE, "--insecure"), 2,
                     f"'{NOT_HERE}' is not an address of this machine", "--host")


def test_gateway_host_that_does_not_resolve_exits_2():
    assert_one_error(cli(*GATEWAY, "--host", "no-such-host.invalid", "--insecure"), 2,
                     "host 'no-such-host.invalid' does not resolve")


@pytest.mark.parametrize("files, message", [
    (lambda c: (c["junk"], c["a"][1]), "client_tls_cert_file '{0}' holds no PEM certificate"),
    (lambda c: (c["a"][0], c["junk"]), "client_tls_key_file '{1}' holds no PEM private key"),
    (lambda c: (c["a"][0], c["b"][1]), "client_tls_key_file '{1}' is not the key of "
                                       "client_tls_cert_file '{0}'"),
    (lambda c: (c["a"][0], c["enc"]), "client_tls_key_file '{1}' is encrypted"),
    (lambda c: ("/nonexistent/gw.crt", c["a"][1]),
     "cannot read client_tls_cert_file '{0}': No such file or directory")])
def test_gateway_bad_client_port_certificate_files_exit_2(certs, files, message):
    cert, key = files(certs)
    r = cli(*GATEWAY, "--client-tls-cert-file", cert, "--client-tls-key-file", key)
    assert_one_error(r, 2, message.format(cert, key))


def test_gateway_bad_metrics_certificate_and_ca_files_exit_2(certs):
    r = cli(*GATEWAY, "--metrics-port", "0", "--metrics-tls-cert-file", certs["a"][0],
            "--metrics-tls-key-file", certs["a"][1], "--metrics-tls-ca-file", certs["junk"])
    assert_one_error(r, 2, f"metrics_tls_ca_file '{certs['junk']}' holds no PEM certificate")


def test_gateway_port_taken_after_the_checks_is_one_line_at_serve_time(held_port):
    """The checks before serving passed (the port was free then): the bind itself fails."""
    code = ("import sys, gateway.main as g; g._check_files = lambda s: None; "
            "sys.exit(g.main(sys.argv[1:]))")
    argv = [*GATEWAY[1:], "--port", str(held_port)]
    assert_one_error(cli(*argv, code=code), 1, f"127.0.0.1:{held_port}",
                     "address already in use")


def test_gateway_model_it_cannot_load_exits_2():
    argv = [*GATEWAY, "--model", "/nonexistent/model"]
    assert_one_error(cli(*argv), 2, "error: the model's configuration and tokenizer cannot be "
                                    "loaded: unknown model spec '/nonexistent/model'")


# ------------------------------------------------------------------ 2. the workers
@pytest.mark.parametrize("role, flag, what", [("colocated", "--port", "the gRPC port"),
                                              ("prefill", "--metrics-port", "the metrics port"),
                                              ("decode", "--kv-port", "the KV receiver port")])
def test_worker_port_in_use_exits_1_before_the_engine_loads(held_port, role, flag, what):
    r = cli(role, *WORKER, flag, str(held_port))
    last = assert_one_error(r, 1, f"127.0.0.1:{held_port}", what, flag,
                            "address already in use")
    assert last.startswith("error: cannot listen")
    assert "configuration" not in r.stderr  # checked before the engine loaded


def test_worker_host_that_is_not_this_machines_exits_2():
    assert_one_error(cli("decode", *WORKER, "--host", NOT_HERE, "--insecure"), 2,
                     f"'{NOT_HERE}' is not an address of this machine")


def test_worker_bad_metrics_certificate_files_exit_2(certs):
    r = cli("colocated", *WORKER, "--metrics-port", "0", "--metrics-tls-cert-file",
            certs["a"][0], "--metrics-tls-key-file", certs["b"][1])
    assert_one_error(r, 2, "metrics_tls_key_file", "is not the key of metrics_tls_cert_file")


def test_worker_bad_cluster_certificate_exits_2(certs):
    r = cli("colocated", *WORKER, "--tls-ca-file", certs["ca"], "--tls-cert-file",
            certs["junk"], "--tls-key-file", certs["a"][1])
    assert_one_error(r, 2, "unreadable certificate or key")


def test_worker_port_taken_after_the_checks_is_one_line_at_serve_time(held_port):
    """The engine loaded, then the gRPC port could not be bound: one line, exit 1, and the
    engine is stopped (the process ends)."""
    code = ("import sys, pdserve.worker as w; w._listens = lambda s: []; "
            "sys.exit(w.main(sys.argv[1:], role='colocated'))")
    argv = [*WORKER[:-1], str(held_port)]
    assert_one_error(cli(*argv, code=code), 1, f"127.0.0.1:{held_port}",
                     "address already in use")


# ------------------------------------------------------------------ 3. host:port
@pytest.mark.parametrize("argv", [
    ["gateway", "--decode-addrs", "::1:50051"],
    ["gateway", "--decode-addrs", "127.0.0.1:1", "--prefill-addrs", "::1:50051"],
    ["decode", "--peer-addrs", "::1:50051"],
    ["decode", "--peer-addrs", "tcp://::1:50051"],
    ["generate", "--address", "::1:50051", "x"],
    ["bench", "--address", "::1:50051"],
    ["bench", "--http-address", "::1:50051"]])
def test_unbracketed_ipv6_host_port_asks_for_brackets(argv):
    last = assert_one_error(cli(*argv), 2, "[::1]:50051", "brackets")
    assert any(f in last for f in ("decode_addrs", "prefill_addrs", "peer_addrs", "--address",
                                   "--http-address")), last


def test_bracketed_ipv6_is_accepted_and_a_worker_serves_on_it():
    from services.config import gateway_settings, worker_settings
    s = gateway_settings(["--decode-addrs", "[::1]:50051", "--prefill-addrs", "[::1]:50052"],
                         env={})
    assert s.decode_addrs == ("[::1]:50051",)
    w = worker_settings(["--role", "decode", "--host", "::1", "--peer-addrs",
                         "[::1]:5,tcp://[::1]:6,shm://x"], env={})
    assert w.advertise_address(7) == "[::1]:7"
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "colocated", *WORKER,
                             "--host", "::1"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY colocated [::1]:"), line
    finally:
        proc.terminate()
        proc.wait(30)


# ------------------------------------------------------------------ 4. pdserve run
@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model"], "unknown model spec '/nonexistent/model'"),
    (["--model", "dummy:tiny", "--device", "cuda"], "no CUDA GPU is visible")])
def test_run_engine_that_cannot_start_exits_2(argv, message):
    if "cuda" in argv:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here")
    r = cli("run", *argv, "x")
    assert_one_error(r, 2, "pdserve run: error: the engine cannot start: ", message)


# ------------------------------------------------------------------ 5. pdserve up
def _processes(marker: str) -> set[int]:
    """Processes whose environment holds ``marker`` (every service a cluster starts inherits
    it), and every redis-server (which rewrites its environment for its process title)."""
    pids = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/comm") as f:
                if f.read().strip() == "redis-server":
                    pids.add(int(d))
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if marker.encode() in f.read():
                    pids.add(int(d))
        except OSError:
            continue
    return pids


def _left_behind(marker: str, before: set[int], wait_s: float = 5.0) -> set[int]:
    """What :func:`_processes` finds that was not there ``before``, after up to ``wait_s``
    for it to end."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = _processes(marker) - before
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server not installed")
UP = ["up", "--port", "0", "--http-port", "0", "--no-demo", "--insecure"]


@needs_redis
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("argv, env, status, message", [
    (["--model", "/nonexistent/model"], {}, 2,
     "the prefill worker did not start: the engine cannot start: unknown model spec "
     "'/nonexistent/model'"),
    (["--model", "dummy:tiny"], {"PDSERVE_QUEUE_FACTOR": "0"}, 2,
     "the gateway did not start: queue_factor must be > 0")])
def test_up_that_cannot_start_stops_what_it_started(argv, env, status, message):
    marker = f"PDSERVE_CLI_TEST_MARK_{uuid.uuid4().hex}"
    before = _processes(marker)
    r = cli(*UP, *argv, env={"CLI_START_FAILURE_MARK": marker, **env}, timeout=120)
    assert_one_error(r, status, "pdserve up: error: ", message)
    assert _left_behind(marker, before) == set()


def test_up_with_its_gateway_port_in_use_exits_1_before_starting_anything(held_port):
    r = cli("up", "--port", str(held_port), "--no-demo", "--insecure")
    assert_one_error(r, 1, "pdserve up: error: ", f"127.0.0.1:{held_port}", "--port",
                     "address already in use")
    assert "starting redis" not in r.stdout


# ------------------------------------------------------------------ 6. secrets as flags
@pytest.mark.parametrize("argv", [
    ["config", "show", "--redis-password", "hunter2"],
    ["config", "show", "--redis-password=hunter2"],
    ["config", "show", "--role", "gateway", "--decode-addrs", "h:1",
     "--redis-password=hunter2"],
    ["config", "show", "--role", "prefill", "--redis-password", "hunter2"],
    ["decode", "--redis-password=hunter2"],
    ["gateway", "--decode-addrs", "h:1", "--redis-password", "hunter2"]])
def test_a_secret_is_never_taken_from_a_flag(argv):
    r = cli(*argv)
    assert_one_error(r, 2, "redis_password is never taken from the command line",
                     "PDSERVE_REDIS_PASSWORD")
    assert "hunter2" not in r.stderr + r.stdout


# ------------------------------------------------------------------ 7. API keys
@pytest.mark.parametrize("key, why", [("abc\ndef", "character 4 is whitespace"),
                                      ("ab cd", "character 3 is whitespace"),
                                      ("caf\u00e9", "character 4 is a non-ASCII character"),
                                      ("a\x01b", "character 2 is a control character")])
def test_client_api_key_must_be_printable_ascii(key, why):
    r = cli("generate", "--address", "127.0.0.1:1", "--api-key", key, "x")
    last = assert_one_error(r, 2, "--api-key: the key must be printable ASCII without "
                                  "whitespace", why)
    assert key not in last


def test_client_api_key_from_the_environment_is_checked_too():
    r = cli("generate", "--address", "127.0.0.1:1", "x", env={"PDSERVE_API_KEY": "ab cd"})
    assert_one_error(r, 2, "api_key must be printable ASCII", "PDSERVE_API_KEY")


@pytest.mark.parametrize("line", ["caf\u00e9", "a\x7fb", "ab cd"])
def test_gateway_refuses_an_api_key_file_with_a_key_clients_cannot_send(tmp_path, line):
    keys = tmp_path / "keys"
    keys.write_text(f"good-key\n{line}\n")
    r = cli(*GATEWAY, "--api-key-file", str(keys))
    last = assert_one_error(r, 2, f"an API key in api_key_file '{keys}' must be printable ASCII")
    assert line not in last


@pytest.mark.parametrize("argv", [["colocated", *WORKER], GATEWAY], ids=["worker", "gateway"])
def test_a_service_whose_redis_password_is_refused_exits_2(argv):
    """Redis down at start is an outage (a worker serves and registers later, a gateway
    routes and discovers later); Redis refusing the service's credentials is its
    configuration: one line, exit 2. The gateway used to log it and serve on."""
    from pdserve.cluster import RedisProcess
    redis = RedisProcess(password="right-one")
    redis.start()
    try:
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", *argv, "--insecure",
                            "--redis-url", f"redis://127.0.0.1:{redis.port}/0"],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    finally:
        redis.stop()
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "right-one" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "refused our credentials: it requires a password " \
        "and none is set" in last, last


# ------------------------------------------------------------------ 7. Ctrl-C while starting
_SWALLOWED = """
import os, signal, sys, time
from services.startup import catch_interrupts
from services.grpc_server import run
catch_interrupts()  # what pdserve's main does first
try:  # a library that catches everything (an import inside torch did) takes the Ctrl-C
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)
except BaseException:
    pass
async def main():
    print("SERVING", flush=True)
try:
    run(main())
except KeyboardInterrupt:
    sys.exit(130)
"""

_DURING_BLOCKING_START = """
import asyncio, os, signal, sys, time
from services.grpc_server import run  # run() alone: no catch_interrupts() before it
async def main():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)  # blocking start work (an engine loading): the Ctrl-C lands in it
    try:  # an await that swallows a cancellation (asyncio.Runner turned Ctrl-C into one)
        await asyncio.sleep(0.1)
    except asyncio.CancelledError:
        pass
    print("SERVING", flush=True)
try:
    run(main())
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("code", [_SWALLOWED, _DURING_BLOCKING_START],
                         ids=["swallowed-before-the-loop", "during-a-blocking-start"])
def test_ctrl_c_while_a_service_starts_is_never_lost(code):
    r = cli(code=code, env={"PYTHONPATH": REPO}, timeout=30)
    assert r.returncode == 130, r.stderr
    assert "SERVING" not in r.stdout
    assert r.stderr == ""  # no traceback, no "never awaited" warning


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals")
def test_ctrl_c_at_any_point_of_a_workers_start_ends_it_cleanly():
    """Ctrl-C at several points of a real worker's start: it exits (130, or killed by
    SIGINT, which is how Python reports an interrupt it could not finish cleanly) and never
    serves on; after READY it drains (0). Once it went on to serve, once it printed
    grpc's InvalidStateError traceback."""
    import signal

    def start():
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "colocated", *WORKER, "--insecure"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")},
            preexec_fn=default_sigint)

    p = start()
    t0 = time.monotonic()
    assert p.stdout.readline().startswith("READY"), p.stderr.read()
    ready_s = time.monotonic() - t0
    p.send_signal(signal.SIGINT)
    assert p.wait(15) == 0
    p.stderr.close()
    p.stdout.close()
    for frac in (0.1, 0.25, 0.4, 0.55, 0.7, 0.85):
        p = start()
        time.sleep(frac * ready_s)
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"Ctrl-C at {frac:.0%} of the start was ignored: {out[-300:]}")
        assert p.returncode in (130, -signal.SIGINT) or (
            p.returncode == 0 and out.startswith("READY")), (frac, p.returncode, err[-2000:])
        assert "Traceback" not in err, (frac, err[-2000:])
