"""The kvtransfer backends, one module each, each declaring itself in a module-level
``BACKEND`` (:class:`kvtransfer.api.BackendSpec`); :mod:`kvtransfer.registry` lists them.
Helper modules of a backend (nccl_lib, nccl_comm, cuda_copy) declare nothing."""
