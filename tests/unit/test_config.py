"""The settings trees and their builder: naming, precedence (file < env < flag < keyword),
validation messages, unknown names, the per-device "auto" values, LLM's keywords."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine.config import (DEVICE_DEFAULTS, CacheConfig, EngineConfig, SchedulerConfig,
                           resolve_engine_config)
from services.config import (ROOTS, ConfigError, engine_config, gateway_settings,
                             resolve_worker, worker_settings)
from pdcore.config_tree import aliases, parse_text, tree


def test_every_setting_has_a_help_line_a_type_and_one_flat_name():
    for root, cls in ROOTS.items():
        specs = tree(cls)  # raises on a name declared twice in one tree
        assert specs, root
        for name, spec in specs.items():
            assert spec.help.strip(), (root, name)
            assert spec.kind in ("int", "float", "bool", "str", "tuple"), (root, name)
            assert spec.flag == "--" + name.replace("_", "-")
            assert spec.var == "PDSERVE_" + name.upper()
    # a name shared by two trees means the same thing: the same type in both
    seen: dict[str, str] = {}
    for cls in ROOTS.values():
        for name, spec in tree(cls).items():
            assert seen.setdefault(name, spec.kind) == spec.kind, name


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_default_file_env_flag(tmp_path):
    toml = _write(tmp_path, "c.toml", 'max_num_seqs = 8\nblock_size = 32\nseed = 5\n'
                                      'heartbeat_s = 0.5\n')
    base = ["--config", toml]
    s = worker_settings(base, env={}, role="decode")
    assert (s.engine.scheduler.max_num_seqs, s.block_size, s.engine.seed) == (8, 32, 5)
    assert s.heartbeat_s == 0.5 and s.engine.scheduler.max_num_batched_tokens == 2048  # default
    env = {"PDSERVE_MAX_NUM_SEQS": "9", "PDSERVE_SEED": "6"}
    s = worker_settings(base, env=env, role="decode")
    assert (s.engine.scheduler.max_num_seqs, s.block_size, s.engine.seed) == (9, 32, 6)
    s = worker_settings(base + ["--max-num-seqs", "10"], env=env, role="decode")
    assert (s.engine.scheduler.max_num_seqs, s.block_size, s.engine.seed) == (10, 32, 6)
    # the file can come from PDSERVE_CONFIG too; --config wins over it
    other = _write(tmp_path, "o.yaml", "max_num_seqs: 3\n")
    assert worker_settings([], env={"PDSERVE_CONFIG": toml}).engine.scheduler.max_num_seqs == 8
    assert worker_settings(["--config", other], env={"PDSERVE_CONFIG": toml}
                           ).engine.scheduler.max_num_seqs == 3
    # LLM: defaults < file < env < keyword
    c = engine_config("dummy:tiny", env=env, config_file=toml, max_num_seqs=11)
    assert (c.scheduler.max_num_seqs, c.cache.block_size, c.seed) == (11, 32, 6)


def test_file_tables_per_entry_point_and_nested_groups(tmp_path):
    yaml_ = _write(tmp_path, "c.yaml", """
model: dummy:tiny
max_num_seqs: 4
cache:
  block_size: 8
engine:
  max_num_seqs: 5
decode:
  max_num_seqs: 6
  kv_backend: shm
gateway:
  decode_addrs: [h:1, h:2]
  prefix_weight: 0.5
""")
    dec = worker_settings(["--config", yaml_], env={}, role="decode")
    pre = worker_settings(["--config", yaml_], env={}, role="prefill")
    assert (dec.engine.scheduler.max_num_seqs, dec.kv_backends, dec.block_size) == (6, ("shm",), 8)
    assert (pre.engine.scheduler.max_num_seqs, pre.kv_backends) == (5, ("tcp",))
    assert engine_config(env={}, config_file=yaml_).scheduler.max_num_seqs == 5
    gw = gateway_settings(["--config", yaml_], env={})
    assert gw.decode_addrs == ("h:1", "h:2") and gw.prefix_weight == 0.5
    assert gw.model == "dummy:tiny" and gw.block_size == 16  # cache.block_size is the engine's


def test_a_setting_of_another_entry_point_is_left_to_it(tmp_path):
    env = {"PDSERVE_MAX_NUM_SEQS": "7", "PDSERVE_PREFIX_WEIGHT": "0.25", "PDSERVE_API_KEY": "k",
           "PDSERVE_TORCH": "", "PDSERVE_KV_TIMELINE": "1"}
    gw = gateway_settings(["--decode-addrs", "h:1"], env=env)
    assert gw.prefix_weight == 0.25
    assert worker_settings([], env=env).engine.scheduler.max_num_seqs == 7
    toml = _write(tmp_path, "c.toml", "prefix_weight = 2.0\n[decode]\nmax_num_seqs = 3\n")
    assert worker_settings(["--config", toml], env={}).engine.scheduler.max_num_seqs == 64


@pytest.mark.parametrize("where, text, message", [
    ("env", {"PDSERVE_MAX_NUM_SEQ": "3"},
     "unknown variable PDSERVE_MAX_NUM_SEQ (did you mean PDSERVE_MAX_NUM_SEQS?)"),
    ("file", "max_num_seq = 3\n",
     "unknown setting max_num_seq (did you mean max_num_seqs?)"),
    ("file", "[decode]\nkv_backends = 'tcp'\n",
     "unknown setting decode.kv_backends (did you mean kv_backend?)"),
    ("file", "[gateway]\nmax_num_seqs = 3\n", "unknown setting gateway.max_num_seqs"),
    ("file", "max_num_seqs = 'many'\n", "max_num_seqs: expected an integer, got 'many'"),
    ("file", "block_size = 24\n", "block_size must be a power of two, got 24"),
    ("file", "max_num_seqs = [\n", "does not parse"),
    ("yaml", "max_num_seqs: 8\nblock_size: 16\nmax_num_seqs: 9\n",
     "does not parse: key 'max_num_seqs' written twice (line 3, column 1)"),
    ("yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n", "is nested too deeply"),
    ("yaml", "max_num_seqs: [1, 2]\n", "max_num_seqs: expected an integer, got a list of 2"),
    ("yaml", "kv_backend: [1, 2]\n", "kv_backend: expected a string, got a list of 2"),
    ("yaml", "max_num_seqs: {a: 1}\n", "max_num_seqs: expected an integer, got a table"),
    ("yaml", "gpu_memory_utilization: 1" + "0" * 400 + "\n",
     "gpu_memory_utilization must be a finite number"),
    ("yaml", "transfer_timeout_s: .inf\n", "transfer_timeout_s must be a finite number"),
    ("yaml", "kv_cache_memory_bytes: 1e400\n", "expected a byte count"),
    ("yaml", "a: &a [x, x]\nb: [*a, *a]\n", "aliases (*name) are not allowed in a config file"),
    ("yaml", "cache:\n  port: 5\n", "unknown setting cache.port"),
    ("yaml", "scheduler:\n  block_size: 32\n", "unknown setting scheduler.block_size"),
    ("yaml", "\"max_num_seqs\\nerror: x\": 3\n", "unknown setting 'max_num_seqs\\nerror: x'"),
])
def test_unknown_and_bad_names_in_files_and_env(tmp_path, where, text, message):
    if where == "env":
        argv, env = [], text
    else:
        name = "c.yaml" if where == "yaml" else "c.toml"
        argv, env = ["--config", _write(tmp_path, name, text)], {}
    with pytest.raises(ConfigError) as e:
        worker_settings(argv, env=env, role="decode")
    assert message in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0 (set by --max-num-seqs)"),
    (["--max-num-seqs", "x"], "--max-num-seqs: expected an integer, got 'x'"),
    (["--max-num-batched-tokens", "-5"], "max_num_batched_tokens must be >= 1, got -5"),
    (["--max-model-len", "0"], "max_model_len must be >= 1, got 0"),
    (["--block-size", "12"], "block_size must be a power of two, got 12"),
    (["--block-size", "0"], "block_size must be >= 1, got 0"),
    (["--num-blocks", "-1"], "num_blocks must be >= 0, got -1"),
    (["--kv-cache-memory-bytes", "0"], "kv_cache_memory_bytes must be >= 1, got 0"),
    (["--kv-cache-memory-bytes", "lots"], "expected a byte count"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be <= 1, got 1.5"),
    (["--gpu-memory-utilization", "0"], "gpu_memory_utilization must be > 0, got 0.0"),
    (["--kv-dtype", "int4"], "kv_dtype must be one of float32, bfloat16, float16, int8, fp8, got 'int4'"),
    (["--quantization", "nf4"], "quantization must be one of none, fp8, int8, int4, got 'nf4'"),
    (["--dtype", "fp8"], "dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    (["--device", "gpu"], "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["--attention-backend", "flash"], "attention_backend must be one of auto, torch, triton"),
    (["--schedule-policy", "sjf"], "schedule_policy must be one of fcfs, short_first, got 'sjf'"),
    (["--policy", "sjf"], "schedule_policy must be one of fcfs, short_first, got 'sjf' (set by "
                          "--policy)"),
    (["--schedule-max-wait-s", "0"], "schedule_max_wait_s must be > 0, got 0.0"),
    (["--mixed-graph-tokens", "-1"], "mixed_graph_tokens must be >= 0, got -1"),
    (["--cuda-graph-max-len", "0"], "cuda_graph_max_len must be >= 1, got 0"),
    (["--num-threads", "-2"], "num_threads must be >= 0, got -2"),
    (["--num-threads", "5000"], "num_threads must be <= 1024, got 5000"),
    (["--seed", "-1"], "seed must be >= 0, got -1"),
    (["--seed", str(2**70)], "seed must be <= 9223372036854775807, got 1180591620717411303424"),
    (["--seed", "9" * 400], "seed must be <= 9223372036854775807, got 999999999999... (400 "
                            "characters)"),
    (["--tensor-parallel-size", "1000"], "tensor_parallel_size must be <= 64, got 1000"),
    (["--block-size", "4096"], "block_size must be <= 1024, got 4096"),
    (["--num-blocks", str(2**40)], "num_blocks must be <= 2147483647"),
    (["--max-num-seqs", str(2**40)], "max_num_seqs must be <= 2147483647"),
    (["--kv-cache-memory-bytes", "1e400"], "expected a byte count"),
    (["--kv-cache-memory-bytes", "2PiB"], "expected a byte count"),
    (["--kv-cache-memory-bytes", "5e15"], "kv_cache_memory_bytes must be <= 1125899906842624"),
    (["--registry-ttl-s", "inf"], "registry_ttl_s must be a finite number, got inf"),
    (["--registry-ttl-s", "1e9"], "registry_ttl_s must be <= 604800, got 1000000000.0"),
    (["--transfer-timeout-s", "nan"], "transfer_timeout_s must be a finite number, got nan"),
    (["--drain-delay-s", "1e400"], "drain_delay_s must be a finite number, got inf"),
    (["--max-message-bytes", "4GiB"], "max_message_bytes must be <= 2147483647"),
    (["--gemv", "always"], "gemv must be one of auto, off, force, got 'always'"),
    (["--model", ""], "model must not be empty"),
    (["--port", "70000"], "port must be <= 65535, got 70000"),
    (["--kv-port", "-1"], "kv_port must be >= 0, got -1"),
    (["--metrics-port", "1e3"], "--metrics-port: expected an integer, got '1e3'"),
    (["--log-level", "LOUD"], "log_level must be one of DEBUG, INFO, WARNING, ERROR"),
    (["--log-format", "xml"], "log_format must be one of json, text, got 'xml'"),
    (["--redis-url", "http://h"], "redis_url must start with redis://, rediss:// or unix://"),
    (["--redis-timeout-s", "0"], "redis_timeout_s must be > 0, got 0.0"),
    (["--grace-s", "-1"], "grace_s must be >= 0, got -1.0"),
    (["--max-message-bytes", "10"], "max_message_bytes must be >= 1024, got 10"),
    (["--heartbeat-s", "5"], "heartbeat_s (5.0) must be shorter than registry_ttl_s (3.0)"),
    (["--transfer-timeout-s", "0"], "transfer_timeout_s must be > 0, got 0.0"),
    (["--role", "router"], "role must be one of prefill, decode, colocated, got 'router'"),
    (["--enable-prefix-caching", "--kv-backend", "tcp,tcp"], "kv_backend must be distinct"),
    (["--kv-backend", "none"], "a decode worker needs a kv_backend"),
    (["--kv-backend", "nccl"], "kv_backend nccl cannot move a KV cache on device 'cpu'"),
])
def test_each_validation_message(argv, message):
    with pytest.raises(ConfigError) as e:
        worker_settings(argv, env={}, role="decode")
    assert message in str(e.value)


def test_auto_and_lists_in_a_file_read_as_in_flags(tmp_path):
    """A file's "auto" is a flag's auto (None), for string settings too; lists of strings."""
    path = _write(tmp_path, "c.yaml", "kv_dtype: auto\nquantization_plan: auto\n"
                                      "async_decode: auto\npeer_addrs: [a:1, 'b:2']\n")
    s = worker_settings(["--config", path], env={}, role="decode", resolve=False)
    assert s.engine.cache.kv_dtype is None and s.engine.quantization_plan is None
    assert s.engine.async_decode is None and s.peer_addrs == ("a:1", "b:2")


def test_gateway_durations_and_sizes_are_bounded():
    for flag, value, message in [
            ("--health-timeout-s", "inf", "health_timeout_s must be a finite number"),
            ("--health-timeout-s", "1e400", "health_timeout_s must be a finite number"),
            ("--request-timeout-s", "1e7", "request_timeout_s must be <= 604800"),
            ("--queue-factor", "1" + "0" * 400, "queue_factor must be a finite number"),
            ("--max-message-bytes", "1e400", "expected a byte count")]:
        with pytest.raises(ConfigError, match=message):
            gateway_settings(["--decode-addrs", "h:1", flag, value], env={})


def test_every_number_setting_is_bounded_above():
    """No setting takes a value that overflows what it ends in (a gRPC option, a timer, a
    torch size): each int and each duration has an upper bound, declared or its kind's."""
    from pdcore.settings import upper_bound
    for root in ROOTS.values():
        for spec in tree(root).values():
            if spec.kind in ("int", "float"):
                assert upper_bound(spec.name, spec.kind, spec.meta) is not None, spec.name


def test_llm_refuses_near_misses_of_its_own_names_and_leaves_other_services_names(tmp_path):
    from engine.llm import engine_config
    with pytest.raises(ConfigError, match=r"unknown variable PDSERVE_MAX_NUM_SEQ \(did you "
                                          r"mean PDSERVE_MAX_NUM_SEQS\?\)"):
        engine_config(model="dummy:tiny", env={"PDSERVE_MAX_NUM_SEQ": "4"})
    with pytest.raises(ConfigError, match=r"unknown setting max_num_seq \(did you mean "
                                          r"max_num_seqs\?\)"):
        engine_config(config_file=_write(tmp_path, "c.toml", "max_num_seq = 4\n"))
    # a whole deployment's environment and file: the services' settings are not the LLM's
    c = engine_config(env={"PDSERVE_API_KEYS": "k", "PDSERVE_DECODE_ADDRS": "h:1",
                           "PDSERVE_MAX_NUM_SEQS": "4"},
                      config_file=_write(tmp_path, "d.toml", "queue_factor = 3\n"
                                         "[gateway]\nstatic_capacity = 9\n"))
    assert c.scheduler.max_num_seqs == 4
    # and no service setting reads as a misspelt engine one
    from pdcore.config_tree import PREFIX, aliases, known_variables, typo
    engine_names = set(aliases(EngineConfig))
    engine_vars = known_variables({"engine": EngineConfig})
    for root in ROOTS.values():
        for name in set(aliases(root)) - engine_names:
            assert not typo(name, engine_names), name
            assert not typo(PREFIX + name.upper(), engine_vars), name


@pytest.mark.parametrize("url, shown", [
    ("redis://u:p@ss@host:6379/0", "redis://u:<redacted>@host:6379/0"),
    ("redis://:pw:with:colons@h:1", "redis://:<redacted>@h:1"),
    ("rediss://h:6379/0?password=hunter2&db=1", "rediss://h:6379/0?password=<redacted>&db=1"),
    ("redis://u:pa/ss@h:1/0", "redis://<redacted>"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("unix:///run/redis.sock?db=0&password=x", "unix:///run/redis.sock?db=0&password=<redacted>"),
])
def test_redis_urls_are_shown_without_their_passwords(url, shown):
    from pdcore.config_tree import redact_url, redacted_flat
    from services.config import redis_url_problem
    assert redact_url(url) == shown
    if redis_url_problem(url):  # refused as a setting, and the refusal shows no password
        with pytest.raises(ConfigError) as e:
            gateway_settings(["--decode-addrs", "h:1", "--redis-url", url], env={})
        assert "pa" not in str(e.value).replace("parse", "") and "hunter2" not in str(e.value)
        return
    s = gateway_settings(["--decode-addrs", "h:1", "--redis-url", url], env={})
    assert redacted_flat(s)["redis_url"] == shown


def test_env_values_are_parsed_and_checked_with_their_variable_named():
    with pytest.raises(ConfigError, match=r"PDSERVE_ENFORCE_EAGER: expected a boolean"):
        worker_settings([], env={"PDSERVE_ENFORCE_EAGER": "maybe"})
    with pytest.raises(ConfigError, match=r"max_num_seqs must be >= 1, got 0 \(set by "
                                          r"PDSERVE_MAX_NUM_SEQS\)"):
        worker_settings([], env={"PDSERVE_MAX_NUM_SEQS": "0"})
    s = worker_settings([], env={"PDSERVE_ENFORCE_EAGER": "on", "PDSERVE_ASYNC_DECODE": "auto",
                                 "PDSERVE_KV_CACHE_MEMORY_BYTES": "512MiB",
                                 "PDSERVE_MAX_MODEL_LEN": "auto"})
    e = s.engine
    assert e.enforce_eager is True and e.async_decode is False  # auto: off without graphs
    assert e.cache.kv_cache_memory_bytes == 512 << 20 and e.scheduler.max_model_len is None


@pytest.mark.parametrize("kind, text, value", [
    ("bool", "yes", True), ("bool", "0", False), ("float", "1e-3", 1e-3),
    ("tuple", "a, b,,c", ("a", "b", "c")), ("bytes", "16GiB", 16 << 30),
    ("bytes", "1.5e9", 1_500_000_000), ("bytes", "4096", 4096), ("bytes", "2k", 2000),
])
def test_text_values(kind, text, value):
    spec = next(s for r in ROOTS.values() for s in tree(r).values()
                if (s.meta.get("unit") == "bytes" if kind == "bytes" else s.kind == kind))
    assert parse_text(spec, text) == value


def test_gateway_static_capacity_and_shedding_are_settings():
    s = gateway_settings(["--decode-addrs", "h:1"], env={})
    assert (s.static_capacity, s.queue_factor) == (64, 2.0)
    s = gateway_settings(["--decode-addrs", "h:1", "--static-capacity", "512",
                          "--queue-factor", "1.5"], env={})
    assert (s.static_capacity, s.queue_factor) == (512, 1.5)
    with pytest.raises(ConfigError, match="static_capacity must be >= 1, got 0"):
        gateway_settings(["--decode-addrs", "h:1", "--static-capacity", "0"], env={})
    with pytest.raises(ConfigError, match="decode_addrs: expected host:port, got 'h'"):
        gateway_settings(["--decode-addrs", "h"], env={})


def test_unknown_flag_names_the_nearest_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        worker_settings(["--max-num-seq", "3"], env={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-num-seq 3 (did you mean --max-num-seqs?)" in err
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------ auto values
def test_auto_resolution_per_device():
    c = EngineConfig()
    cpu = resolve_engine_config(c, cuda_available=False)
    assert (cpu.device, cpu.dtype, cpu.async_decode) == ("cpu", "float32", False)
    assert cpu.scheduler.max_num_seqs == DEVICE_DEFAULTS["cpu"]["max_num_seqs"] == 64
    assert cpu.scheduler.max_num_batched_tokens == 2048
    gpu = resolve_engine_config(c, cuda_available=True)
    assert (gpu.device, gpu.dtype, gpu.async_decode) == ("cuda", "bfloat16", True)
    assert (gpu.scheduler.max_num_seqs, gpu.scheduler.max_num_batched_tokens) == (512, 8192)
    assert resolve_engine_config(c, cuda_available=True,
                                 checkpoint_dtype="float16").dtype == "float16"
    assert resolve_engine_config(c, cuda_available=True, checkpoint_dtype="float32",
                                 bf16_supported=False).dtype == "float16"
    # the CPU stays float32 whatever the checkpoint; explicit values are kept
    assert resolve_engine_config(c, cuda_available=False,
                                 checkpoint_dtype="bfloat16").dtype == "float32"
    mine = EngineConfig(device="cuda:1", dtype="float32", enforce_eager=True,
                        scheduler=SchedulerConfig(max_num_seqs=3))
    r = resolve_engine_config(mine, cuda_available=True)
    assert (r.device, r.dtype, r.async_decode, r.scheduler.max_num_seqs) == (
        "cuda:1", "float32", False, 3)
    assert r.scheduler.max_num_batched_tokens == 8192


def test_kv_backend_defaults_per_role_and_device():
    def kv(role, cuda, argv=()):
        s = worker_settings(list(argv), env={}, role=role, resolve=False)
        return resolve_worker(s, cuda_available=cuda).kv_backends

    assert kv("colocated", False) == () and kv("colocated", True) == ()
    assert kv("decode", False) == ("tcp",) and kv("prefill", False) == ("tcp",)
    assert kv("decode", True) == ("cuda_ipc", "nccl") == kv("prefill", True)
    assert kv("colocated", True, ["--kv-backend", "nccl"]) == ("nccl",)
    # tcp stages a GPU cache through host memory; GPU-only backends refuse a CPU cache
    assert kv("decode", True, ["--kv-backend", "tcp"]) == ("tcp",)
    with pytest.raises(ConfigError, match=r"nccl cannot move a KV cache on device 'cpu'"):
        kv("decode", False, ["--kv-backend", "nccl"])
    s = resolve_worker(worker_settings([], env={}, role="decode", resolve=False),
                       cuda_available=True)
    assert s.engine.device == "cuda" and s.engine.scheduler.max_num_seqs == 512


def test_llm_builder_accepts_every_engine_setting():
    """Each engine setting, set by its name to a non-default value, lands in the tree."""
    values = {"int": 3, "float": 0.5, "str": None, "bool": None, "tuple": ("x",)}
    for name, spec in tree(EngineConfig).items():
        if spec.meta.get("choices"):
            v = next(c for c in spec.meta["choices"] if c != spec.default)
        elif spec.kind == "bool":
            v = not spec.default if spec.default is not None else True
        elif name == "device":
            v = "cuda:1"
        elif name == "block_size":
            v = 64
        elif spec.kind == "str":
            v = "spec-" + name
        else:
            v = values[spec.kind]
        extra = {"kv_dtype": "fp8"} if name == "kv_scales" else {}  # scales need codes
        c = engine_config(**{"model": "dummy:tiny", "env": {}, name: v, **extra})
        got = c
        for attr in spec.path:
            got = getattr(got, attr)
        assert got == v, name
    # aliases: the older names of the scheduling policy
    c = engine_config("dummy:tiny", env={}, policy="short_first", max_wait_s=0.25)
    assert (c.scheduler.schedule_policy, c.scheduler.schedule_max_wait_s) == ("short_first", 0.25)
    with pytest.raises(TypeError, match=r"unknown setting 'max_num_seq' \(did you mean "
                                        r"max_num_seqs\?\)"):
        engine_config("dummy:tiny", env={}, max_num_seq=4)


def test_llm_runs_with_every_engine_setting_set():
    """LLM(model, **kw) with all engine settings at once (CPU-compatible values)."""
    from engine import LLM, SamplingParams
    kw = dict(dtype="float32", device="cpu", seed=3, attention_backend="torch",
              enforce_eager=True, mixed_graph_tokens=0, cuda_graph_max_len=256, num_threads=1,
              async_decode=True, block_size=8, num_blocks=64, kv_cache_memory_bytes=1 << 20,
              gpu_memory_utilization=0.5, enable_prefix_caching=False, hash_seed="h",
              kv_dtype="float32", kv_scales="dynamic", kv_block_runs=False, max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=200, policy="short_first",
              schedule_max_wait_s=0.5, gemv="off", gemv_pdl=False, gemv_split_k=True,
              fuse_rotary=False, split_mixed=False, cpu_packed=False,
              tensor_parallel_size=2, tensor_parallel_timeout_s=20.0,
              quantization="none", quantization_plan=None,  # (TP refuses quantized weights)
              quantized_weights=None,
              grammar_cache_size=8, grammar_compile_timeout_s=2.0, grammar_max_size=50_000,
              grammar_lexer_fuel=500_000)
    assert set(kw) | {"model", "schedule_policy"} - {"policy"} >= set(tree(EngineConfig)) - {
        "model", "schedule_policy"}
    llm = LLM("dummy:tiny", **kw)
    c = llm.engine.config
    assert (c.scheduler.schedule_policy, c.cache.num_blocks, c.scheduler.max_model_len) == (
        "short_first", 64, 200)
    assert llm.engine.block_manager._runs is False and c.kernels.cpu_packed is False
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert c.tensor_parallel_size == 2 and len(llm.engine.runner.tp.pids) == 1
    llm.close()


def test_max_model_len_auto_is_the_model_maximum_capped_by_the_kv_cache():
    from engine import LLM
    big = LLM("dummy:tiny", num_blocks=512, block_size=16).engine  # 8192 tokens of KV
    assert big.max_model_len == big.model_config.max_position == 2048
    assert big.config.scheduler.max_model_len == 2048
    small = LLM("dummy:tiny", num_blocks=8, block_size=16).engine  # 128 tokens of KV
    assert small.max_model_len == 128 == small.config.scheduler.max_model_len
    with pytest.raises(ValueError, match="context limit is 128"):
        small.validate(list(range(1, 129)), _sp())
    # on the CPU the KV cache stays 1 GiB unless told otherwise
    cpu = LLM("dummy:tiny").engine
    assert cpu.config.device == "cpu" and cpu.config.dtype == "float32"
    assert cpu.config.cache.kv_cache_memory_bytes == cpu.runner.num_blocks * (
        cpu.runner.kv_cache.numel() // cpu.runner.num_blocks * 4)
    assert abs(cpu.config.cache.kv_cache_memory_bytes - (1 << 30)) < (1 << 20)


def _sp():
    from engine import SamplingParams
    return SamplingParams(max_tokens=1)


def test_kv_budget_arithmetic():
    from engine.kv_memory import GPU_RESERVE_BYTES, kv_budget_bytes, profile_lengths
    gib = 1 << 30
    # one worker on a 140 GiB device: 0.9 of it less weights+activations and the reserve
    assert kv_budget_bytes(140 * gib, 120 * gib, 17 * gib, 0.9) == int(0.9 * 140 * gib) - (
        17 * gib) - GPU_RESERVE_BYTES
    # a second worker at 0.45 whose share exceeds what is free gets what is free
    assert kv_budget_bytes(140 * gib, 40 * gib, 17 * gib, 0.45) == 40 * gib - GPU_RESERVE_BYTES
    assert kv_budget_bytes(140 * gib, 140 * gib, 200 * gib, 0.9) == 0
    assert profile_lengths(8192, 512, 131072) == [[8192], [16] * 512]
    assert profile_lengths(2048, 64, 2048) == [[2047], [32] * 64]
    assert profile_lengths(100, 64, 4096)[1] == [2] * 36 + [1] * 28


def test_profile_step_runs_on_a_scratch_cache_and_leaves_the_runner_as_it_was():
    from engine import LLM
    from engine.kv_memory import profile_step
    r = LLM("dummy:tiny", num_blocks=16, block_size=4).engine.runner
    cache = r.kv_cache
    before = cache.clone()
    profile_step(r, [37])
    profile_step(r, [3] * 9)
    assert r.kv_cache is cache and r.eager_steps == 0 and not r.generators
    assert bool((r.kv_cache == before).all())


def test_resolved_worker_settings_round_trip_through_show(tmp_path, capsys):
    from pdserve.config_cli import show
    argv = ["--role", "gateway", "--decode-addrs", "h:1,h:2", "--api-keys", "s3cret",
            "--redis-url", "redis://user:pa55@r:6379/0", "--prefix-weight", "0.5"]
    assert show(argv) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "pa55" not in out
    assert 'redis_url = "redis://user:<redacted>@r:6379/0"  # --redis-url' in out
    assert "# api_keys = <redacted>  (secret)  # --api-keys" in out
    # what show prints is a config file that reads back (secrets aside)
    path = tmp_path / "shown.toml"
    path.write_text(out.replace("<redacted>", "pw"))
    again = gateway_settings(["--config", str(path)], env={})
    assert again.decode_addrs == ("h:1", "h:2") and again.prefix_weight == 0.5
    assert again.api_keys == ()
    assert show(["--role", "decode", "--format", "json", "--max-num-seqs", "7"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["max_num_seqs"] == 7 and shown["device"] == "cpu"
    assert shown["kv_backend"] == "tcp" and shown["role"] == "decode"
    assert show(["--role", "decode", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be >= 1" in capsys.readouterr().err


def test_settings_repr_and_metric_labels_redact_secrets():
    from pdcore.config_tree import redacted_flat
    s = gateway_settings(["--decode-addrs", "h:1", "--api-keys", "k1,k2",
                          "--redis-url", "rediss://:hunter2@r/0"], env={})
    assert "k1" not in repr(s) and "hunter2" not in repr(s)
    flat = redacted_flat(s)
    assert flat["api_keys"] == "<redacted>" and "hunter2" not in flat["redis_url"]
    assert flat["decode_addrs"] == "h:1" and flat["static_capacity"] == "64"


def test_frozen_trees_only_validate():
    c = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 32  # type: ignore[misc]
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1.0  # int -> float
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false"):
        CacheConfig(enable_prefix_caching="yes")  # type: ignore[arg-type]
    assert aliases(EngineConfig)["policy"] == "schedule_policy"


def test_a_gpu_device_without_a_gpu_is_a_clear_error():
    import torch
    from engine import LLM
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match="device 'cuda:0': no CUDA GPU is visible"):
        LLM("dummy:tiny", device="cuda:0")


def test_every_process_takes_the_gil_switch_interval_from_one_setting():
    from services.config import client_settings, gateway_settings
    env = {"PDSERVE_GIL_SWITCH_INTERVAL_US": "250"}
    gw = ["--decode-addrs", "127.0.0.1:1"]
    for build in (lambda: worker_settings([], env=env), lambda: gateway_settings(gw, env=env),
                  lambda: client_settings(env=env)):
        assert build().gil_switch_interval_us == 250.0
    assert gateway_settings(gw, env={}).gil_switch_interval_us == 100.0
    with pytest.raises(ConfigError, match="gil_switch_interval_us must be > 0"):
        worker_settings(["--gil-switch-interval-us", "0"], env={})


def test_only_small_regular_files_are_read_as_config(tmp_path):
    """A FIFO would block forever, /dev/zero or a huge file exhaust memory: refused first."""
    import os
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    zero = tmp_path / "z.yaml"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_text("#" * (2 << 20))
    for path, message in ((fifo, "is not a regular file"), (zero, "is not a regular file"),
                          (big, "is larger than 1048576 bytes"),
                          (tmp_path, "is not a regular file")):
        with pytest.raises(ConfigError, match=message):
            worker_settings(["--config", str(path)], env={}, role="decode")
    with pytest.raises(ConfigError, match="api_key_file .* is not a regular file"):
        gateway_settings(["--decode-addrs", "h:1", "--api-key-file", str(fifo)], env={})
    s = worker_settings(["--redis-password-file", str(zero)], env={}, role="decode")
    with pytest.raises(ValueError, match="is not a regular file"):
        s.redis_auth()  # read when the worker starts


def test_yaml_numbers_read_as_yaml_1_2(tmp_path):
    """YAML 1.1 would read 0777 as octal 511 and 1:30 as 90 without a word."""
    path = _write(tmp_path, "c.yaml", "port: 0777\nkv_cache_memory_bytes: 1.5e9\n"
                                      "grace_s: 0x10\n")
    s = worker_settings(["--config", path], env={}, role="decode", resolve=False)
    assert (s.port, s.engine.cache.kv_cache_memory_bytes, s.grace_s) == (777, 1_500_000_000,
                                                                          16.0)
    with pytest.raises(ConfigError, match="schedule_max_wait_s: expected a number, got '1:30'"):
        worker_settings(["--config", _write(tmp_path, "d.yaml", "schedule_max_wait_s: 1:30\n")],
                        env={}, role="decode")
