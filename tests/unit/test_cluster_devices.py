"""LocalCluster(devices=...): each worker's --device, the GPU environment, CPU unchanged.
No processes: the spawn step is replaced by a recorder."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from pdserve.cluster import GPU_ENV, LocalCluster, Service


def _flag(args: list[str], name: str):
    """The value of the last ``name`` flag in ``args`` (argparse: the last one wins)."""
    vals = [args[i + 1] for i, a in enumerate(args) if a == name]
    return vals[-1] if vals else None


class _Recorder:
    """Stands in for LocalCluster._spawn: remembers (kind, args), returns a fake live service."""

    def __init__(self):
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, kind: str, args: list[str]) -> Service:
        self.calls.append((kind, list(args)))
        proc = SimpleNamespace(pid=0, poll=lambda: None)  # a process that never ran
        return Service(kind, proc, address=f"127.0.0.1:{60000 + len(self.calls)}",
                       worker_id=f"w{len(self.calls)}")


def _start_without_processes(c: LocalCluster, monkeypatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(c, "_spawn", rec)
    monkeypatch.setattr(c, "_wait_ready", lambda svcs, stop_on_failure=True: None)
    c.start()
    return rec


def test_1p1d_devices_per_role(monkeypatch):
    c = LocalCluster("dummy:tiny", prefill=1, decode=1, redis=False,
                     devices={"prefill": ["cuda:0"], "decode": ["cuda:1"]})
    rec = _start_without_processes(c, monkeypatch)
    by_kind = {k: a for k, a in rec.calls}
    assert _flag(by_kind["prefill"], "--device") == "cuda:0"
    assert _flag(by_kind["decode"], "--device") == "cuda:1"
    assert "--device" not in by_kind["gateway"]
    # the --num-threads split is unchanged: two workers share the cores
    want = str(max(1, (os.cpu_count() or 1) // 2))
    assert _flag(by_kind["prefill"], "--num-threads") == want


def test_colocated_one_device_each_in_order(monkeypatch):
    c = LocalCluster("dummy:tiny", prefill=0, decode=0, colocated=2, redis=False,
                     devices={"colocated": ["cuda:0", "cuda:1"]})
    rec = _start_without_processes(c, monkeypatch)
    devs = [_flag(a, "--device") for k, a in rec.calls if k == "colocated"]
    assert devs == ["cuda:0", "cuda:1"]
    # a worker started later takes the next device of its role, cycling through the list
    c.start_worker("colocated", wait=False)
    assert _flag(rec.calls[-1][1], "--device") == "cuda:0"


def test_gpu_env_set_and_cuda_visible_devices_untouched(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # forced off whatever the caller had
    c = LocalCluster("dummy:tiny", devices={"prefill": ["cuda:0"], "decode": ["cuda:1"]},
                     env={"FOO": "bar"})
    for k, v in GPU_ENV.items():
        assert c.env[k] == v
    assert GPU_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}
    assert c.env["CUDA_VISIBLE_DEVICES"] == "0,1"  # every worker sees both GPUs
    assert c.env["FOO"] == "bar"


def test_cpu_unchanged(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    plain = LocalCluster("dummy:tiny", prefill=1, decode=1)
    cpu = LocalCluster("dummy:tiny", prefill=1, decode=1,
                       devices={"prefill": ["cpu"], "decode": ["cpu"]})
    assert "NCCL_NVLS_ENABLE" not in plain.env and "NCCL_NVLS_ENABLE" not in cpu.env
    assert "--device" not in plain.worker_cmd_args("prefill")
    assert plain.worker_cmd_args("decode") == plain.worker_cmd_args("decode", 3)
    a = cpu.worker_cmd_args("decode")
    assert _flag(a, "--device") == "cpu"
    assert [x for x in a if x not in ("--device", "cpu")] == plain.worker_cmd_args("decode")


def test_worker_args_come_last_and_keep_num_threads():
    c = LocalCluster("dummy:tiny", colocated=1, prefill=0, decode=0,
                     devices={"colocated": ["cuda:1"]},
                     worker_args=("--num-threads", "3", "--dtype", "bfloat16"))
    a = c.worker_cmd_args("colocated")
    assert _flag(a, "--device") == "cuda:1"
    assert a.count("--num-threads") == 1 and _flag(a, "--num-threads") == "3"
    assert a[-2:] == ["--dtype", "bfloat16"]


def test_role_args_go_to_that_role_only_after_the_shared_args(monkeypatch):
    c = LocalCluster("dummy:tiny", prefill=1, decode=2, redis=False,
                     worker_args=("--max-num-batched-tokens", "2048"),
                     role_args={"decode": ("--max-num-batched-tokens", "512")},
                     gateway_args=("--local-prefill-max-tokens", "512"))
    rec = _start_without_processes(c, monkeypatch)
    budgets = [(k, _flag(a, "--max-num-batched-tokens")) for k, a in rec.calls if k != "gateway"]
    assert budgets == [("prefill", "2048"), ("decode", "512"), ("decode", "512")]
    dec = next(a for k, a in rec.calls if k == "decode")
    assert dec[-4:] == ["--max-num-batched-tokens", "2048", "--max-num-batched-tokens", "512"]
    gw = rec.calls[-1][1]
    assert rec.calls[-1][0] == "gateway" and gw == c.gateway_cmd_args()
    assert gw[-2:] == ["--local-prefill-max-tokens", "512"]
    assert _flag(gw, "--decode-addrs") == "127.0.0.1:60002,127.0.0.1:60003"
    assert _flag(gw, "--prefill-addrs") == "127.0.0.1:60001"
    # a role's own --num-threads replaces the shared split for that role
    c2 = LocalCluster("dummy:tiny", role_args={"prefill": ("--num-threads", "997")})
    assert c2.worker_cmd_args("prefill").count("--num-threads") == 1
    assert _flag(c2.worker_cmd_args("prefill"), "--num-threads") == "997"
    assert _flag(c2.worker_cmd_args("decode"), "--num-threads") != "997"


@pytest.mark.parametrize("devices, worker_args, role_args", [
    ({"verifier": ["cuda:0"]}, (), None),
    ({"prefill": []}, (), None),
    ({"prefill": ["cuda:0"]}, ("--device", "cuda:1"), None),
    ({"prefill": ["cuda:0"]}, (), {"decode": ("--device", "cuda:1")}),
    (None, (), {"verifier": ("--dtype", "float32")}),
])
def test_bad_devices_rejected(devices, worker_args, role_args):
    with pytest.raises(ValueError):
        LocalCluster("dummy:tiny", devices=devices, worker_args=worker_args,
                     role_args=role_args)


def test_workers_sharing_a_gpu_split_its_memory(monkeypatch):
    """pdserve up --device cuda: the prefill and the decode worker share cuda:0, so each may
    use half of gpu_memory_utilization; a worker alone on its GPU keeps the default, and a
    worker given its own memory flag keeps it."""
    from engine.config import CacheConfig
    half = f"{CacheConfig().gpu_memory_utilization / 2:.4f}"
    c = LocalCluster("dummy:tiny", prefill=1, decode=1, redis=False,
                     devices={"prefill": ["cuda"], "decode": ["cuda:0"]})
    rec = _start_without_processes(c, monkeypatch)
    shares = [_flag(a, "--gpu-memory-utilization") for k, a in rec.calls if k != "gateway"]
    assert shares == [half, half] and c.workers_on("cuda") == 2
    assert all("--kv-backend" not in a for _, a in rec.calls)  # the workers' default (auto)
    apart = LocalCluster("dummy:tiny", devices={"prefill": ["cuda:0"], "decode": ["cuda:1"]})
    assert _flag(apart.worker_cmd_args("decode"), "--gpu-memory-utilization") is None
    own = LocalCluster("dummy:tiny", colocated=2, prefill=0, decode=0,
                       devices={"colocated": ["cuda:0"]},
                       worker_args=("--kv-cache-memory-bytes", "8GiB"))
    assert _flag(own.worker_cmd_args("colocated"), "--gpu-memory-utilization") is None
    third = LocalCluster("dummy:tiny", prefill=1, decode=2, devices={
        "prefill": ["cuda:0"], "decode": ["cuda:0", "cuda:1"]})
    assert _flag(third.worker_cmd_args("prefill"), "--gpu-memory-utilization") == half
    assert _flag(third.worker_cmd_args("decode", 1), "--gpu-memory-utilization") is None
    assert LocalCluster("dummy:tiny").workers_on("cpu") == 0


def test_up_device_reaches_every_worker(monkeypatch):
    from pdserve import cli
    seen = {}

    class Stop(Exception):
        pass

    def fake_cluster(model, **kw):
        seen.update(kw)
        raise Stop
    monkeypatch.setattr("pdserve.cluster.LocalCluster", fake_cluster)
    with pytest.raises(Stop):
        cli.main(["up", "--device", "cuda", "--no-demo"])
    assert seen["devices"] == {r: ["cuda"] for r in ("prefill", "decode", "colocated")}
    assert seen["kv_backend"] is None
