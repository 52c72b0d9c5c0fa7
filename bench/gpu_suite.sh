#!/usr/bin/env bash
# The GPU runs of issues 4 and 5, in steps that fit the device tool's 10-minute calls.
# On the GPU machine, from the repository root (carry .whl, see scripts/device_env.sh):
#
#   source scripts/device_env.sh && bash bench/gpu_suite.sh STEP... 2>&1 | tee $OUT/suite.log
#
# Steps (results go to $OUT, named after the step; minutes are estimates on 2 x H200):
#   tests        pytest -m gpu tests/gpu (kernels, engine incl. async_decode, kvtransfer)  ~4
#   sweep        bench/gemv_sweep.py: GEMV configs incl. split-K vs cuBLAS                ~3
#   engine-a     bench/gpu_engine.py section a: default, split-K, async_decode, both       ~6
#   engine-full  bench/gpu_engine.py sections d,a,c,b with the best flags (FLAGS=...)      ~6
#   transfer     bench/kv_transfer_gpu.py (2 GPUs)                                          ~2
#   disagg       bench/disagg_gpu.py nccl 1P1D vs colocated, rates 4,8,16,32 (2 GPUs)     ~7
#   ipc16        bench/disagg_gpu.py 1P1D only, 16 req/s, cuda_ipc then nccl (2 GPUs)      ~4
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { echo "=== $*" >&2; "$@" || echo "=== FAILED ($?): $*" >&2; }
for step in "$@"; do
  case $step in
    tests) run python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider ;;
    sweep) run python3 bench/gemv_sweep.py --out "$OUT/gemv_sweep_h200.json" ;;
    engine-a)
      run python3 bench/gpu_engine.py --sections a --out "$OUT/gpu_engine_a_base.json"
      PDSERVE_GEMV_SPLIT_K=1 run python3 bench/gpu_engine.py --sections a \
        --out "$OUT/gpu_engine_a_splitk.json"
      run python3 bench/gpu_engine.py --sections a --async-decode \
        --out "$OUT/gpu_engine_a_async.json"
      PDSERVE_GEMV_SPLIT_K=1 run python3 bench/gpu_engine.py --sections a --async-decode \
        --out "$OUT/gpu_engine_a_splitk_async.json" ;;
    engine-full) run python3 bench/gpu_engine.py --sections d,a,c,b ${FLAGS:-} \
        --out "$OUT/gpu_engine_h200.json" ;;
    transfer) run python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer_gpu_h200.json" ;;
    disagg) run python3 bench/disagg_gpu.py --kv-backend nccl,cuda_ipc \
        --colocated-kv-backend nccl --time-budget 540 --out "$OUT/disagg_gpu_h200_nccl.json" ;;
    ipc16) run python3 bench/disagg_gpu.py --deployments 1p1d --rates 16 \
        --kv-backend cuda_ipc,nccl --out "$OUT/disagg_gpu_h200_cuda_ipc_16.json" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
