"""Worker settings: the KV backend list and the device it must suit, refused at startup."""
from __future__ import annotations

import pytest

from services.config import ConfigError, worker_settings


@pytest.mark.parametrize("argv, backends", [
    (["--kv-backend", "tcp"], ("tcp",)),
    (["--kv-backend", "shm,tcp"], ("shm", "tcp")),
    (["--device", "cuda:1", "--kv-backend", "nccl,cuda_ipc"], ("nccl", "cuda_ipc")),
    (["--device", "cuda", "--kv-backend", "nixl"], ("nixl",)),
    (["--kv-backend", "nixl, tcp"], ("nixl", "tcp")),
    # tcp and shm move a GPU cache through pinned host memory (kvtransfer.staging)
    (["--device", "cuda:0", "--kv-backend", "tcp"], ("tcp",)),
    (["--device", "cuda:0", "--kv-backend", "nccl,shm"], ("nccl", "shm")),
])
def test_backend_lists(argv, backends):
    assert worker_settings(argv, env={}).kv_backends == backends


@pytest.mark.parametrize("argv, message", [
    (["--kv-backend", "nccl"], "need a cuda device"),
    (["--kv-backend", "tcp,cuda_ipc"], "cuda_ipc cannot move"),
    (["--kv-backend", "tcp,tcp"], "distinct"),
    (["--kv-backend", "carrier-pigeon"], "distinct names"),
    (["--kv-backend", ","], "distinct names"),
])
def test_bad_backend_lists_are_refused_with_a_reason(argv, message):
    with pytest.raises(ConfigError, match=message):
        worker_settings(argv, env={})


def test_env_var_sets_the_list():
    s = worker_settings([], env={"PDSERVE_KV_BACKEND": "nccl,cuda_ipc", "PDSERVE_DEVICE": "cuda"})
    assert s.kv_backends == ("nccl", "cuda_ipc")


def test_schedule_policy_reaches_the_engine_and_bad_values_are_refused():
    from services.worker_runtime import engine_config

    s = worker_settings(["--schedule-policy", "short_first", "--schedule-max-wait-s", "0.5"],
                        env={})
    sched = engine_config(s).scheduler
    assert (sched.schedule_policy, sched.schedule_max_wait_s) == ("short_first", 0.5)
    assert engine_config(worker_settings([], env={})).scheduler.schedule_policy == "fcfs"
    with pytest.raises(ConfigError, match="schedule_policy must be one of"):
        worker_settings(["--schedule-policy", "sjf"], env={})
    with pytest.raises(ConfigError, match="schedule_max_wait_s"):
        worker_settings(["--schedule-max-wait-s", "0"], env={})


def test_mixed_graph_tokens_reaches_the_engine_and_negative_is_refused():
    from services.worker_runtime import engine_config

    assert engine_config(worker_settings([], env={})).mixed_graph_tokens == 512
    s = worker_settings(["--mixed-graph-tokens", "0"], env={})
    assert engine_config(s).mixed_graph_tokens == 0
    with pytest.raises(ConfigError, match="mixed_graph_tokens must be >= 0"):
        worker_settings(["--mixed-graph-tokens", "-1"], env={})
