"""pdserve command line.

    pdserve up [--prefill N] [--decode M] [--colocated K] [--model SPEC] [--port P] [--device D]
               [--insecure]   (default: throw-away CA, mutual TLS, Redis password)
    pdserve gateway | prefill | decode | colocated [service flags, see --help]
    pdserve generate --address HOST:PORT "prompt"      pdserve chat --address HOST:PORT
    pdserve run --model SPEC [engine flags] "prompt"    (offline, in-process engine)
    pdserve bench ...                                   (serving benchmark)
    pdserve chaos [--scenario NAME] [--model SPEC]      (fault injection against a local cluster)
    pdserve eval [--base k=v,..] --candidate [NAME=]k=v,..  (output quality vs a baseline)
    pdserve quantize --plan --out PLAN.json [--model SPEC] (mixed-precision sensitivity sweep)
    pdserve config show [--role R] [flags]              (the resolved configuration)
    pdserve config docs [--out FILE | --check]          (docs/configuration.md)
    pdserve certs --out DIR [--hosts H,...]             (a cluster CA, per-role certificates
                                                         and a Redis password, for deployments)
    pdserve hash-key                                    (an API key read from stdin -> its hash)

Every setting and its flag, variable and default: docs/configuration.md.

A command that cannot start prints one line, "error: ...", and exits 2 when a value given to
it is wrong (a flag, variable or config-file value; a file, model or host it names), 1 when
the machine refuses (a port another process holds); pdserve up stops what it started and
names the service that failed (services/startup.py).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

DEMO_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _up_args(argv):
    from pdserve.argtypes import Parser, integer
    from services.config import backend_devices
    p = Parser(prog="pdserve up", description="start a whole local cluster")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefill", type=integer(0, 64), default=1)
    p.add_argument("--decode", type=integer(0, 64), default=1)
    p.add_argument("--colocated", type=integer(0, 64), default=0)
    p.add_argument("--port", type=integer(0, 65535), default=50051, help="gateway port")
    p.add_argument("--http-port", type=integer(0, 65535), default=8000,
                   help="gateway's OpenAI-compatible HTTP port (0: off)")
    p.add_argument("--served-model-name", default="",
                   help="model name the HTTP API accepts besides the model's id")
    p.add_argument("--device", default=None, help="every worker's device (cpu, cuda, cuda:N); "
                   "workers sharing a GPU split its memory; default: the workers' (auto)")
    p.add_argument("--kv-backend", default=None, choices=sorted(backend_devices()),
                   help="default: the workers' (tcp on the CPU, cuda_ipc,nccl on a GPU)")
    p.add_argument("--no-demo", action="store_true", help="skip the sample request")
    p.add_argument("--exit-after-demo", action="store_true", help="stop after the sample request")
    p.add_argument("--verbose", action="store_true", help="echo every service's log")
    p.add_argument("--insecure", action="store_true",
                   help="no TLS between the services, Redis without a password")
    a = p.parse_args(argv)
    if a.prefill + a.decode + a.colocated == 0 or (a.prefill and not a.decode):
        p.error("need --decode >= 1 with --prefill, or --colocated >= 1")
    if a.device is not None:
        from engine.config import EngineConfig
        try:
            EngineConfig(device=a.device)
        except ValueError as e:
            p.error(str(e))
    return a


def _cmd_up(argv) -> int:
    from pdserve.cluster import LocalCluster, StartFailed
    from services.startup import StartError, check_listen
    a = _up_args(argv)
    try:  # the gateway's ports, before anything starts (workers take free ones)
        check_listen("the gateway's gRPC port: --port", "127.0.0.1", a.port)
        if a.http_port:
            check_listen("the gateway's HTTP port: --http-port", "127.0.0.1", a.http_port)
    except StartError as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return e.status
    print(f"starting redis, {a.prefill} prefill, {a.decode} decode, {a.colocated} colocated "
          f"worker(s) and a gateway on :{a.port} (model {a.model}) ...", flush=True)
    devices = None
    if a.device is not None:
        devices = {role: [a.device] for role in ("prefill", "decode", "colocated")}
    cluster = LocalCluster(a.model, prefill=a.prefill, decode=a.decode, colocated=a.colocated,
                           gateway_port=a.port, kv_backend=a.kv_backend, echo=a.verbose,
                           devices=devices, secure=not a.insecure,
                           http_port=a.http_port or None,
                           gateway_args=(("--served-model-name", a.served_model_name)
                                         if a.served_model_name else ()))
    # SIGTERM (docker stop, timeout, kill) must stop the cluster too, like Ctrl-C: the
    # services run in their own sessions and would otherwise outlive us
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    try:
        cluster.start()
    except KeyboardInterrupt:
        cluster.stop()
        return 130
    except StartFailed as e:  # what started is stopped: one line, the service's own reason
        cluster.stop()
        what = "gateway" if e.kind == "gateway" else f"{e.kind} worker"
        print(f"pdserve up: error: the {what} did not start: {e.reason}", file=sys.stderr)
        return e.status
    except (RuntimeError, TimeoutError, OSError) as e:  # redis-server, registration
        cluster.stop()
        print(f"pdserve up: error: the cluster did not start: {' '.join(str(e).split())}",
              file=sys.stderr)
        return 1
    from pdcore.config_tree import redact_url
    print(f"up in {time.monotonic() - t0:.1f}s: gateway {cluster.address}, redis "
          f"{redact_url(cluster.redis_url)}, "
          + (f"mutual TLS (certificates in {cluster.identity.directory})" if cluster.identity
             else "INSECURE (plaintext, no Redis password)")
          + (f", OpenAI API http://{cluster.http_address}/v1" if cluster.http_address
             else ""))
    for w in cluster.workers:
        print(f"  {w.kind:9s} {w.address}  {w.worker_id}")
    try:
        if not a.no_demo:
            from pdserve import client
            req = client.make_request(messages=DEMO_MESSAGES, max_tokens=48, temperature=0.0)

            async def demo():
                async with client.channel(cluster.address) as ch:
                    from protos.pdserve.v1 import gateway_pb2_grpc
                    print(f"\n> {DEMO_MESSAGES[0]['content']}\n< ", end="", flush=True)
                    c = await client.generate(gateway_pb2_grpc.GatewayStub(ch), req, timeout=120,
                                              on_text=lambda t: print(t, end="", flush=True))
                    print(f"\n[{c.completion_tokens} tokens, TTFT {c.ttft_s*1000:.0f} ms, "
                          f"{c.latency_s:.2f} s, finish={c.finish_reason}]\n")
            asyncio.run(demo())
        if a.exit_after_demo:
            return 0
        print(f"serving on {cluster.address}; try: pdserve generate --address {cluster.address} "
              "\"Hello\"   (Ctrl-C to stop)", flush=True)
        while True:  # a service that dies is restarted; the others keep serving
            time.sleep(1)
            for event in cluster.supervise_once():
                print(event, file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


def _client_args(prog: str, argv, chat: bool):
    from pdcore.settings import MAX_SECONDS
    from pdserve.argtypes import Parser, address, api_key, integer, number
    p = Parser(prog=prog)
    p.add_argument("--address", type=address, default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=integer(1, 2**32 - 1), default=128)
    p.add_argument("--temperature", type=number(0.0), default=0.0)
    p.add_argument("--top-p", type=number(gt=0.0, hi=1.0), default=None)
    p.add_argument("--top-k", type=integer(-1, 2**31 - 1), default=0, help="0 or -1: off")
    p.add_argument("--seed", type=integer(0, 2**64 - 1), default=None)
    p.add_argument("--timeout", type=number(gt=0.0, hi=MAX_SECONDS), default=300)
    p.add_argument("--api-key", type=api_key, default=None,
                   help="key for a gateway started with API keys (printable ASCII, no "
                   "whitespace) [default: $PDSERVE_API_KEY]")
    if not chat:
        p.add_argument("prompt")
    return p.parse_args(argv)


def _cmd_generate(argv, chat: bool = False) -> int:
    import grpc
    from pdserve import client
    from protos.pdserve.v1 import gateway_pb2_grpc
    prog = "pdserve chat" if chat else "pdserve generate"
    a = _client_args(prog, argv, chat)
    if a.api_key is None:  # $PDSERVE_API_KEY / the config file, checked like the flag
        from services.config import ConfigError, client_settings
        try:
            a.api_key = client_settings().api_key
        except ConfigError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
    kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
              seed=a.seed)

    async def one(req):
        async with client.channel(a.address, api_key=a.api_key) as ch:
            return await client.generate(gateway_pb2_grpc.GatewayStub(ch), req, timeout=a.timeout,
                                         on_text=lambda t: print(t, end="", flush=True))
    try:
        if not chat:
            c = asyncio.run(one(client.make_request(a.prompt, **kw)))
            print(f"\n[finish={c.finish_reason} tokens={c.completion_tokens} cached={c.cached_tokens}]")
            return 0
        history = []
        while True:
            try:
                line = input("you> ")
            except EOFError:
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            print("bot> ", end="", flush=True)
            c = asyncio.run(one(client.make_request(messages=history, **kw)))
            print()
            history.append({"role": "assistant", "content": c.text})
    except grpc.aio.AioRpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


def _cmd_run(argv) -> int:
    from engine.config import EngineConfig
    from pdserve.argtypes import integer, number
    from services.config import ConfigError, ROOTS
    from pdcore.config_tree import build, parser
    p = parser(EngineConfig, "pdserve run", "offline, in-process generation; every engine "
               "setting is a flag (docs/configuration.md)")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--max-tokens", type=integer(1), default=64)
    p.add_argument("--temperature", type=number(0.0), default=0.0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    a = p.parse_strict(argv)
    try:
        config, _ = build(EngineConfig, roots=ROOTS, namespace=a, sections=("engine",))
    except ConfigError as e:
        print(f"pdserve run: error: {e}", file=sys.stderr)
        return 2
    from engine import SamplingParams
    from engine.llm import LLM
    from services.startup import StartError, engine_starting
    try:
        with engine_starting():  # the worker's rule: one line, exit 2
            llm = LLM.from_config(config)
    except StartError as e:
        print(f"pdserve run: error: {e}", file=sys.stderr)
        return e.status
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature)
    t0 = time.perf_counter()
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": q}] for q in a.prompt], sp)
    else:
        outs = llm.generate(a.prompt, sp)
    dt = time.perf_counter() - t0
    for q, o in zip(a.prompt, outs):
        print(f"> {q}\n< {o.text}\n  [{len(o.token_ids)} tokens, {o.finish_reason.value}]")
    print(f"{sum(len(o.token_ids) for o in outs) / dt:.1f} tok/s")
    return 0


def _cmd_certs(argv) -> int:
    from pdserve.argtypes import Parser
    from services.tls import write_cluster_files
    p = Parser(prog="pdserve certs", description="mint a cluster CA, a certificate and key "
               "per role and a Redis password (docs/security.md)")
    p.add_argument("--out", required=True, help="folder to write (made 0700)")
    p.add_argument("--hosts", default="", help="extra DNS names / IPs in every certificate")
    p.add_argument("--keep", action="store_true", help="do nothing if the folder already "
                   "holds a CA (a compose volume on the next start)")
    p.add_argument("--readable", action="store_true", help="keys and passwords readable by "
                   "every user (0644): a volume only this deployment's containers mount, "
                   "whose processes run as other users (compose)")
    a = p.parse_args(argv)
    if a.keep and os.path.exists(os.path.join(a.out, "ca.crt")):
        print(f"{a.out} already holds a cluster CA: kept")
        return 0
    hosts = [h for h in a.hosts.split(",") if h]
    files = write_cluster_files(a.out, hosts=["127.0.0.1", "localhost", *hosts])
    with open(files.redis_password_file) as f:
        password = f.read().strip()
    # redis-server reads this file (never the password on its command line)
    with open(os.path.join(a.out, "redis.conf"), "w") as f:
        os.chmod(f.name, 0o600)
        f.write(f"requirepass {password}\n")
    if a.readable:
        for name in os.listdir(a.out):
            os.chmod(os.path.join(a.out, name), 0o644)
        os.chmod(a.out, 0o755)
    print(f"wrote {a.out}: ca.crt, ca.key (keep offline), <role>.crt/.key for gateway, "
          f"prefill, decode, colocated, operator; redis-password, redis.conf")
    return 0


def main(argv=None) -> int:
    """Every command, with the last word on what escapes one: Ctrl-C is exit 130 without a
    traceback; a file it could not read or write, text it could not encode, a cluster that
    did not start: one line, exit 2 (1 when the machine refused)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else ""
    if cmd in ("gateway", "prefill", "decode", "colocated"):
        from services.startup import catch_interrupts
        catch_interrupts()  # before the heavy imports: a Ctrl-C among them is not lost
    from pdserve.cluster import StartFailed
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        print(f"pdserve {cmd}: interrupted", file=sys.stderr)
        return 130
    except StartFailed as e:
        what = "gateway" if e.kind == "gateway" else f"{e.kind} worker"
        print(f"pdserve {cmd}: error: the {what} did not start: {e.reason}", file=sys.stderr)
        return e.status
    except OSError as e:  # a path given to it: --out, --workload, ...
        where = f": {e.filename!r}" if getattr(e, "filename", None) else ""
        print(f"pdserve {cmd}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except UnicodeError as e:  # a prompt or key that is not valid text
        print(f"pdserve {cmd}: error: input is not valid UTF-8 text ({e.reason})",
              file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        return _cmd_up(rest)
    if cmd == "gateway":
        from gateway.main import main as gw
        return gw(rest)
    if cmd in ("prefill", "decode", "colocated"):
        from pdserve.worker import main as wk
        return wk(rest, role=cmd)
    if cmd == "generate":
        return _cmd_generate(rest)
    if cmd == "chat":
        return _cmd_generate(rest, chat=True)
    if cmd == "run":
        return _cmd_run(rest)
    if cmd == "bench":
        from pdserve.bench import main as bench
        return bench(rest)
    if cmd == "chaos":
        from pdserve.chaos.cli import main as chaos
        return chaos(rest)
    if cmd == "eval":
        from pdserve.eval_cli import main as evaluate
        return evaluate(rest)
    if cmd == "quantize":
        from pdserve.quantize_cli import main as quantize
        return quantize(rest)
    if cmd == "config":
        from pdserve.config_cli import main as config
        return config(rest)
    if cmd == "certs":
        return _cmd_certs(rest)
    if cmd == "hash-key":
        from services.auth import api_key_problem
        from services.tls import api_key_hash
        if rest:
            print("pdserve hash-key: reads one API key from stdin and prints its hash (for "
                  "api_key_file); it takes no arguments", file=sys.stderr)
            return 0 if rest in (["-h"], ["--help"]) else 2
        key = sys.stdin.readline().strip()
        if not key:
            print("error: no key on stdin", file=sys.stderr)
            return 2
        problem = api_key_problem(key)
        if problem:
            print(f"pdserve hash-key: error: the key {problem}", file=sys.stderr)
            return 2
        print(api_key_hash(key))
        return 0
    print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
