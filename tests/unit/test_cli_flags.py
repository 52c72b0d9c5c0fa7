"""Every CLI flag is type- and range-checked: a bad value is one line on stderr and exit
status 2, never a traceback."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from pdserve.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_with_a_negative_max_tokens_is_one_line_and_exit_2():
    """The issue's example, as a user runs it (a real process, nothing listening)."""
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--max-tokens", "-1",
                        "x"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "argument --max-tokens: must be in 1..4294967295, got -1" in r.stderr


@pytest.mark.parametrize("flag, message", [
    (["--quantized-weights", "/nonexistent/w.safetensors"], "quantized_weights"),
    (["--quantization-plan", "/nonexistent/plan.json"], "quantization plan"),
    (["--model", "/nonexistent/model"], "unknown model spec")])
def test_a_worker_that_cannot_load_its_files_exits_2_with_one_error_line(flag, message):
    """Files are read when the engine loads: a worker names the bad one, no traceback."""
    argv = ["--model", "dummy:tiny", *flag] if flag[0] != "--model" else flag
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "colocated", "--port", "0",
                        "--log-format", "text", *argv], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"error: the engine cannot start: {message}" in r.stderr


@pytest.mark.parametrize("flag, message", [
    (["--kv-dtype", "float16"], "kv_dtype float16 with the model in float32"),
    (["--attention-backend", "triton"], "attention_backend triton needs a GPU")])
def test_choices_that_cannot_run_together_on_this_device_exit_2(flag, message):
    """Each value is valid alone; together, on the CPU, they cannot run: the engine says so
    when it starts (these used to crash the first request)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "colocated", "--port", "0",
                        "--log-format", "text", "--model", "dummy:tiny", *flag],
                       capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"error: the engine cannot start: {message}" in r.stderr


def test_check_runnable_names_each_conflict():
    from engine.config import EngineConfig, SettingError, check_runnable, resolve_engine_config
    c = resolve_engine_config(EngineConfig(model="dummy:tiny"), cuda_available=False)
    check_runnable(c)
    with pytest.raises(SettingError, match="kv_dtype bfloat16 with the model in float32"):
        check_runnable(dataclasses.replace(c, cache=dataclasses.replace(c.cache,
                                                                        kv_dtype="bfloat16")))
    for kv in ("float32", "int8", "fp8"):  # the model's own dtype and the quantized ones run
        check_runnable(dataclasses.replace(c, cache=dataclasses.replace(c.cache, kv_dtype=kv)))
    triton = dataclasses.replace(c, attention_backend="triton")
    with pytest.raises(SettingError, match="attention_backend triton needs a GPU"):
        check_runnable(triton)
    check_runnable(triton, triton_interpreted=True)  # the kernel tests' interpreter


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-tokens", "ten", "x"], "--max-tokens: expected an integer, got 'ten'"),
    (["generate", "--temperature", "-0.5", "x"], "--temperature: must be >= 0, got -0.5"),
    (["generate", "--temperature", "nan", "x"], "expected a finite number, got 'nan'"),
    (["generate", "--top-p", "0", "x"], "--top-p: must be > 0, got 0"),
    (["generate", "--top-p", "1.5", "x"], "--top-p: must be <= 1, got 1.5"),
    (["generate", "--top-k", "-2", "x"], "--top-k: must be in -1.."),
    (["generate", "--seed", "-1", "x"], "--seed: must be in 0.."),
    (["generate", "--timeout", "0", "x"], "--timeout: must be > 0, got 0"),
    (["generate", "--address", "localhost", "x"], "expected host:port, got 'localhost'"),
    (["chat", "--max-tokens", "0"], "--max-tokens: must be in 1.."),
    (["up", "--prefill", "-1"], "--prefill: must be in 0..64, got -1"),
    (["up", "--port", "65536"], "--port: must be in 0..65535, got 65536"),
    (["up", "--http-port", "70000"], "--http-port: must be in 0..65535, got 70000"),
    (["gateway", "--decode-addrs", "h:1", "--http-port", "-1"], "http_port must be >= 0"),
    (["gateway", "--decode-addrs", "h:1", "--http-max-body-bytes", "10"],
     "http_max_body_bytes must be >= 1024"),
    (["bench", "--apis", "grpc,soap", "--address", "h:1"], "expected apis like grpc,openai"),
    (["bench", "--api", "soap", "--address", "h:1"], "--api: invalid choice"),
    (["up", "--device", "gpu0"], "device must be auto, cpu, cuda or cuda:N"),
    (["up", "--kv-backend", "carrier-pigeon"], "--kv-backend: invalid choice"),
    (["up", "--prefill", "1", "--decode", "0"], "need --decode >= 1 with --prefill"),
    (["run", "--max-tokens", "0", "x"], "--max-tokens: must be in 1..2147483647, got 0"),
    (["run", "--max-num-seq", "2", "x"], "did you mean --max-num-seqs?"),
    (["bench", "--rate", "-1", "--address", "h:1"], "--rate: must be > 0, got -1"),
    (["bench", "--rates", "1,x", "--address", "h:1"], "--rates: expected a number, got 'x'"),
    (["bench", "--concurrency", "0", "--address", "h:1"], "--concurrency: must be in 1.."),
    (["bench", "--num-requests", "many", "--address", "h:1"], "expected an integer"),
    (["bench", "--input-len", "9:3", "--address", "h:1"], "expected 1 <= LO <= HI, got '9:3'"),
    (["bench", "--long-frac", "2", "--address", "h:1"], "--long-frac: must be in 0..1"),
    (["bench", "--address", "nohost", "--rate", "1"], "expected host:port, got 'nohost'"),
    (["config", "show", "--role", "router"], "--role: invalid choice"),
    (["gateway", "--port", "x", "--decode-addrs", "h:1"], "--port: expected an integer"),
    (["gateway", "--decode-addrs", "h:1", "--queue-factor", "0"], "queue_factor must be > 0"),
    (["decode", "--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
    (["decode", "--kv-backend", "nccl"], "nccl cannot move a KV cache on device 'cpu'"),
    (["prefill", "--gpu-memory-utilization", "2"], "gpu_memory_utilization must be <= 1"),
    (["colocated", "--enforce-eager=yes"], "ignored explicit argument 'yes'"),
    (["up", "--prefill", "100000"], "--prefill: must be in 0..64, got 100000"),
    (["generate", "--timeout", "1e9", "x"], "--timeout: must be <= 604800, got 1e+09"),
    (["generate", "--max-tokens", "9" * 5000, "x"], "--max-tokens: expected an integer"),
    (["decode", "--num-threads", "5000"], "num_threads must be <= 1024, got 5000"),
    (["decode", "--registry-ttl-s", "inf"], "registry_ttl_s must be a finite number"),
    (["decode", "--tensor-parallel-size", "1000"], "tensor_parallel_size must be <= 64"),
    (["gateway", "--decode-addrs", "h:1", "--health-timeout-s", "1e400"],
     "health_timeout_s must be a finite number, got inf"),
    (["bench", "--address", "h:1", "--rate", "2", "--duration", "1e308"],
     "--duration: must be <= 604800"),
    (["bench", "--address", "h:1", "--rate", "1", "--input-len", "9" * 20],
     "--input-len: expected HI <= 10000000"),
    (["bench", "--address", "h:1", "--rate", "1", "--num-requests", "2147483647"],
     "--num-requests: must be in 1..10000000"),
    (["bench", "--up", "--prefill", "100000"], "--prefill: must be in 0..64"),
    (["bench", "--http-address", "h:1", "--rate", "1"],
     "pdserve bench: error: give --address, --up, --compare or --compare-up"),
    (["bench", "--address", "127.0.0.1:1", "--workload", "/nonexistent/w.jsonl", "--rate", "1"],
     "pdserve bench: error: No such file or directory: '/nonexistent/w.jsonl'"),
    (["config", "docs", "--out", "/"], "pdserve config: error: Is a directory: '/'"),
    (["eval", "--set", "../../x", "--candidate", "a=seed=1"],
     "--set: expected a folder name (letters, digits, _ . -), got '../../x'"),
    # output paths are checked before the run (its result was lost at the end)
    (["eval", "--candidate", "a=seed=1", "--out", "/"],
     "--out: cannot write '/': it is a folder (name a file in it)"),
    (["quantize", "--plan", "--out", "/tmp"], "--out: cannot write '/tmp': it is a folder"),
    (["bench", "--address", "h:1", "--rate", "1", "--out", "/"],
     "--out: cannot write '/': it is a folder"),
    (["eval", "--candidate", ""], "--candidate '' sets nothing: give k=v,..."),
    # names that passed their character pattern but name nothing
    (["decode", "--advertise-host", "a..b"],
     "advertise_host 'a..b': a host name has no empty part between dots"),
    (["decode", "--advertise-host=-w"],
     "advertise_host '-w': a part of a host name neither starts nor ends with '-'"),
    (["decode", "--advertise-host", "300.1.1.1"],
     "advertise_host '300.1.1.1': dotted numbers that are not an IPv4 address"),
    (["gateway", "--decode-addrs", "h:1,h:1"], "decode_addrs: 'h:1' is listed twice"),
    (["gateway", "--decode-addrs", "a..b:1"],
     "decode_addrs: 'a..b' in 'a..b:1' is not a host"),
    (["eval", "--candidate", " =seed=1"],
     "--candidate ' =seed=1': the name before the first '=' is empty"),
    (["generate", "--address", "127.0.0.1:1", "a\udcff"],
     "pdserve generate: error: input is not valid UTF-8 text"),
    (["decode", "--redis-url", "redis://127.0.0.1:99999"],
     "redis_url: port out of range 0-65535"),
    (["gateway", "--redis-url", "redis://127.0.0.1:abc"], "redis_url: port is not a number"),
    (["decode", "--redis-url", "redis://127.0.0.1:6379/abc"],
     "redis_url: database 'abc' is not a number"),
    (["decode", "--redis-url", "unix://"], "redis_url: unix:// needs the socket's path"),
    (["decode", "--redis-url", "redis://h:1/0?socket_timeout=x"],
     "redis_url: socket_timeout='x' is not a number"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("PDSERVE_CONFIG", raising=False)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_unknown_variable_is_refused_by_every_service(capsys, monkeypatch):
    monkeypatch.setenv("PDSERVE_MAX_NUM_SEQ", "4")
    for argv in (["decode"], ["gateway", "--decode-addrs", "h:1"]):
        assert main(argv) == 2
        assert "unknown variable PDSERVE_MAX_NUM_SEQ (did you mean PDSERVE_MAX_NUM_SEQS?)" in \
            capsys.readouterr().err


def test_run_takes_engine_settings_as_flags(capsys):
    """pdserve run: the offline engine with any engine setting as a flag."""
    assert main(["run", "--model", "dummy:tiny", "--num-blocks", "32", "--block-size", "8",
                 "--max-num-seqs", "2", "--policy", "short_first", "--max-tokens", "3",
                 "hello", "world"]) == 0
    out = capsys.readouterr().out
    assert out.count("[3 tokens, length]") == 2 and "tok/s" in out


@pytest.mark.parametrize("stdin, argv, code, message", [
    ("a b\n", [], 2, "the key must be printable ASCII without whitespace; character 2 is "
                     "whitespace"),
    ("\u043a\u043b\n", [], 2, "a non-ASCII character"),
    ("", [], 2, "no key on stdin"),
    ("abc\n", ["--help"], 0, "reads one API key from stdin"),
    ("abc\n", ["extra"], 2, "it takes no arguments")])
def test_hash_key_takes_only_a_usable_key(stdin, argv, code, message):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "hash-key", *argv], input=stdin,
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == code and message in r.stderr, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_hash_key_hashes_a_good_key():
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "hash-key"], input="k-1\n",
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and len(r.stdout.strip()) > 20, r.stderr
