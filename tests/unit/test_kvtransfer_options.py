"""kvtransfer options: frozen dataclasses that validate, declared by each backend's module; the
environment is read in one function (registry.options_from_env), never by kvtransfer itself."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest

from kvtransfer import ListenAddress, make_receiver, make_sender, registry
from kvtransfer.api import KVTransferOptions
from kvtransfer.backends.cuda_ipc import CudaIpcOptions
from kvtransfer.backends.nccl import NcclOptions
from kvtransfer.backends.shm import ShmOptions
from kvtransfer.backends.tcp import TcpOptions

from tests.unit.kvtransfer_helpers import ROOT, SMALL, cache, run


def test_every_backend_declares_typed_options_with_help_lines():
    for name in registry.backends():
        found = registry.spec(name)
        assert found.name == name and found.devices and set(found.devices) <= {"cpu", "cuda"}
        options = found.options()  # every field has a default
        for f in dataclasses.fields(options):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help line"
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options, dataclasses.fields(options)[0].name, None)
    for f in dataclasses.fields(KVTransferOptions):
        assert f.metadata.get("help")


def test_options_check_types_and_ranges():
    with pytest.raises(ValueError, match="copy_lanes must be in 1..64"):
        CudaIpcOptions(copy_lanes=0)
    with pytest.raises(ValueError, match="layers_per_message must be >= 0"):
        NcclOptions(layers_per_message=-1)
    with pytest.raises(ValueError, match="chunk_bytes must be of type int"):
        ShmOptions(chunk_bytes="8M")
    with pytest.raises(ValueError, match="num_slots must be of type int"):
        ShmOptions(num_slots=True)
    with pytest.raises(ValueError, match="timeline must be of type bool"):
        KVTransferOptions(timeline=1)
    with pytest.raises(ValueError, match="port must be in 0..65535"):
        ListenAddress(port=70000)


def test_options_from_env_maps_each_documented_variable():
    shared, per = registry.options_from_env({})
    assert shared == KVTransferOptions()
    assert per == {name: registry.spec(name).options() for name in registry.backends()}
    env = {"PDSERVE_KV_TIMELINE": "1", "PDSERVE_NCCL_LAYERS_PER_MESSAGE": "2",
           "PDSERVE_NCCL_PACK_MESSAGE_BYTES": "0", "PDSERVE_NCCL_LIB": "/opt/libnccl.so.2",
           "PDSERVE_CUDA_IPC_LANES": "3", "PDSERVE_BATCH_COPY": "0",
           "PDSERVE_DRIVER_COPY": "off", "PDSERVE_KERNEL_COPY_BELOW_BYTES": "4096",
           "PDSERVE_NIXL_MAX_DESCRIPTOR_BYTES": "33554432", "NIXL_LOG_LEVEL": "INFO",
           "PDSERVE_KV_CHECKSUMS": "no", "PDSERVE_KV_CORRUPT_EVERY": "3",
           "PDSERVE_UNRELATED": "x"}
    shared, per = registry.options_from_env(env)
    assert shared == KVTransferOptions(timeline=True, checksums=False, corrupt_every=3)
    assert per["nccl"] == NcclOptions(layers_per_message=2, pack_message_bytes=0,
                                      library="/opt/libnccl.so.2")
    assert per["cuda_ipc"] == CudaIpcOptions(copy_lanes=3, batch_copy=False, driver_copy=False,
                                             kernel_copy_below_bytes=4096)
    assert per["nixl"].max_descriptor_bytes == 32 << 20 and per["nixl"].verbose_logs
    assert per["tcp"] == TcpOptions()
    assert set(registry.ENV_OPTIONS) == {v for v in env if v != "PDSERVE_UNRELATED"}
    assert registry.options_from_env({"PDSERVE_KV_TIMELINE": "0"})[0].timeline is False
    assert registry.options_from_env({"PDSERVE_KV_TIMELINE": ""})[0].timeline is False


@pytest.mark.parametrize("env, message", [
    ({"PDSERVE_CUDA_IPC_LANES": "0"}, "PDSERVE_CUDA_IPC_LANES.*copy_lanes must be in 1..64"),
    ({"PDSERVE_CUDA_IPC_LANES": "two"}, "PDSERVE_CUDA_IPC_LANES='two': not an integer"),
    ({"PDSERVE_BATCH_COPY": "maybe"}, "PDSERVE_BATCH_COPY='maybe': expected one of"),
    ({"PDSERVE_NCCL_LAYERS_PER_MESSAGE": "-4"}, "layers_per_message must be >= 0"),
])
def test_options_from_env_names_the_variable_of_a_bad_value(env, message):
    with pytest.raises(ValueError, match=message):
        registry.options_from_env(env)


def test_make_sender_and_receiver_take_options_and_check_them():
    c = cache(SMALL, 4)
    with pytest.raises(TypeError, match="takes ShmOptions, got TcpOptions"):
        make_sender("shm", c, SMALL, TcpOptions())
    with pytest.raises(ValueError, match="no option chunk_size; it has chunk_bytes"):
        make_sender("shm", c, SMALL, chunk_size=1)
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        make_sender("shm", c, SMALL, num_slots=0)
    with pytest.raises(ValueError, match="listens on no TCP port"):
        make_receiver("shm", c, SMALL, listen=ListenAddress())

    async def main():
        rx = make_receiver("shm", c, SMALL, ShmOptions(socket_name=f"pdkv-opt-{id(c)}"))
        await rx.start()
        assert rx.endpoint == f"shm://pdkv-opt-{id(c)}"
        await rx.close()
        rx = make_receiver("tcp", c, SMALL, listen=ListenAddress("127.0.0.1", 0, "kv.example"))
        await rx.start()
        assert rx.endpoint.startswith("tcp://kv.example:")
        await rx.close()

    run(main())


def test_the_timeline_option_logs_each_transfers_phases(caplog):
    async def main(shared):
        src, dst = cache(SMALL, 8, seed=1), cache(SMALL, 8)
        rx = make_receiver("tcp", dst, SMALL, shared=shared)
        await rx.start()
        tx = make_sender("tcp", src, SMALL, shared=shared)
        handle = rx.expect("tl", [0, 1], 5)
        assert (await tx.send("tl", rx.endpoint, [2, 3], 5)).ok and (await handle.wait()).ok
        await tx.close()
        await rx.close()

    with caplog.at_level(logging.INFO, logger="kvtransfer.lifecycle"):
        run(main(KVTransferOptions()))
        assert "kv timeline" not in caplog.text
        run(main(KVTransferOptions(timeline=True)))
    lines = [r.getMessage() for r in caplog.records if "kv timeline" in r.getMessage()]
    assert any(line.startswith("kv timeline send tl done:") and "acked=" in line
               for line in lines), lines
    assert any(line.startswith("kv timeline recv tl done:") and "landed=" in line
               for line in lines), lines


def test_kvtransfer_reads_no_environment_variable():
    """Options come in as objects: no module of kvtransfer reads os.environ / os.getenv
    (registry.options_from_env takes the mapping it reads as an argument)."""
    stray = []
    for path in sorted((ROOT / "kvtransfer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv",
                                                                 "environb"):
                stray.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert stray == []
    assert Path(registry.__file__).name == "registry.py"
