"""A small ctypes binding to libnccl: point-to-point send/recv on non-blocking communicators.

Only what the nccl backend needs: unique ids, communicator init / abort, grouped send and
recv, and the async-error query that non-blocking communicators are driven by. Every
communicator is created non-blocking (``config.blocking = 0``), so no call here ever waits
on a peer: callers poll :meth:`NcclLib.state` and abort on their own timeout.

The library is the path given (``NcclOptions.library``) when there is one, else the one
PyTorch already loaded (soname ``libnccl.so.2``), else the ``nvidia-nccl`` wheel's copy. The
first load decides for the whole process.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading

SUCCESS = 0
IN_PROGRESS = 7
_UINT8 = 1  # ncclUint8
_UNDEF_INT = -(2 ** 31)  # NCCL_CONFIG_UNDEF_INT
UNIQUE_ID_BYTES = 128

_ERRORS = {1: "unhandled CUDA error", 2: "system error", 3: "internal error",
           4: "invalid argument", 5: "invalid usage", 6: "remote error (peer failed)",
           7: "in progress"}


class NcclError(RuntimeError):
    def __init__(self, what: str, code: int, detail: str = "") -> None:
        self.code = code
        text = f"{what}: NCCL {_ERRORS.get(code, f'error {code}')}"
        super().__init__(f"{text} ({detail})" if detail else text)


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.17 (newer libraries read older layouts by size/version)."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int),
                ("minCTAs", ctypes.c_int), ("maxCTAs", ctypes.c_int),
                ("netName", ctypes.c_char_p)]


def _candidates(library: str) -> list[str]:
    out = [library] if library else []
    out.append("libnccl.so.2")
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        out.append(os.path.join(base, "lib", "libnccl.so.2"))
    out.append("libnccl.so")
    return out


class NcclLib:
    def __init__(self, library: str = "") -> None:
        import torch  # noqa: F401 - loads torch's libnccl first, so the soname resolves to it
        del torch

        errors = []
        for path in _candidates(library):
            try:
                self._lib = ctypes.CDLL(path)
                self.path = path
                break
            except OSError as exc:
                errors.append(f"{path}: {exc}")
        else:
            raise RuntimeError("libnccl not found (give its path: NcclOptions.library): "
                               + "; ".join(errors))
        lib = self._lib
        R = ctypes.c_int
        vp = ctypes.c_void_p
        self._fn("ncclGetVersion", R, [ctypes.POINTER(ctypes.c_int)])
        self._fn("ncclGetErrorString", ctypes.c_char_p, [R])
        self._fn("ncclGetUniqueId", R, [ctypes.POINTER(_UniqueId)])
        self._fn("ncclCommInitRankConfig", R,
                 [ctypes.POINTER(vp), ctypes.c_int, _UniqueId, ctypes.c_int,
                  ctypes.POINTER(_Config)])
        self._fn("ncclCommGetAsyncError", R, [vp, ctypes.POINTER(R)])
        self._fn("ncclCommAbort", R, [vp])
        self._fn("ncclGroupStart", R, [])
        self._fn("ncclGroupEnd", R, [])
        self._fn("ncclSend", R, [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp])
        self._fn("ncclRecv", R, [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp])
        try:
            self._fn("ncclGetLastError", ctypes.c_char_p, [vp])
        except AttributeError:
            pass
        v = ctypes.c_int()
        self._check("ncclGetVersion", lib.ncclGetVersion(ctypes.byref(v)))
        self.version_code = v.value
        major, rest = divmod(v.value, 10000)
        self.version = f"{major}.{rest // 100}.{rest % 100}"
        # group calls are per thread in NCCL; one lock keeps start..end of a group together
        self.group_lock = threading.Lock()

    def _fn(self, name: str, restype, argtypes) -> None:
        f = getattr(self._lib, name)
        f.restype, f.argtypes = restype, argtypes

    def _check(self, what: str, code: int, comm: int | None = None) -> int:
        if code not in (SUCCESS, IN_PROGRESS):
            detail = ""
            if comm is not None and hasattr(self._lib, "ncclGetLastError"):
                raw = self._lib.ncclGetLastError(ctypes.c_void_p(comm))
                detail = raw.decode(errors="replace") if raw else ""
            raise NcclError(what, code, detail)
        return code

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self._check("ncclGetUniqueId", self._lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid.internal)

    def init_rank(self, uid: bytes, nranks: int, rank: int) -> int:
        """Start creating a non-blocking communicator on the CURRENT CUDA device; returns the
        handle at once. Poll :meth:`state` until SUCCESS (or abort it)."""
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL unique id must be {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        uid_s = _UniqueId()
        ctypes.memmove(uid_s.internal, uid, UNIQUE_ID_BYTES)
        cfg = _Config(ctypes.sizeof(_Config), 0xCAFEBEEF, 21700, 0, _UNDEF_INT, _UNDEF_INT,
                      _UNDEF_INT, None)
        comm = ctypes.c_void_p()
        self._check("ncclCommInitRankConfig", self._lib.ncclCommInitRankConfig(
            ctypes.byref(comm), nranks, uid_s, rank, ctypes.byref(cfg)))
        if not comm.value:
            raise NcclError("ncclCommInitRankConfig", 3, "no communicator returned")
        return comm.value

    def state(self, comm: int) -> int:
        """SUCCESS (idle / done), IN_PROGRESS, or raises NcclError for a failed communicator."""
        res = ctypes.c_int()
        self._check("ncclCommGetAsyncError",
                    self._lib.ncclCommGetAsyncError(ctypes.c_void_p(comm), ctypes.byref(res)))
        return self._check("communicator", res.value, comm)

    def abort(self, comm: int) -> None:
        """Tear the communicator down, ending any operation still queued on it."""
        self._lib.ncclCommAbort(ctypes.c_void_p(comm))

    def group(self, comm: int, ops: list[tuple[str, int, int]], peer: int, stream: int) -> int:
        """Enqueue ``ops`` (``("send"|"recv", device_ptr, nbytes)``) as one NCCL group on
        ``stream``. Returns SUCCESS or IN_PROGRESS (poll :meth:`state` before the next call)."""
        with self.group_lock:
            self._check("ncclGroupStart", self._lib.ncclGroupStart())
            code = SUCCESS
            try:
                for op, ptr, nbytes in ops:
                    fn = self._lib.ncclSend if op == "send" else self._lib.ncclRecv
                    self._check(f"nccl{op.title()}", fn(ctypes.c_void_p(ptr), nbytes, _UINT8,
                                                        peer, ctypes.c_void_p(comm),
                                                        ctypes.c_void_p(stream)), comm)
            finally:
                code = self._check("ncclGroupEnd", self._lib.ncclGroupEnd(), comm)
            return code


_LIB: NcclLib | None = None
_LIB_LOCK = threading.Lock()


def lib(library: str = "") -> NcclLib:
    """The process's NCCL binding, loaded on first use (``library``: a path to try first)."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            _LIB = NcclLib(library)
        return _LIB
