#!/usr/bin/env bash
# The GPU runs, in steps that fit one 10-minute device call each.
# On the GPU machine, from the repository root (carry .whl, see scripts/device_env.sh):
#
#   source scripts/device_env.sh && bash bench/gpu_suite.sh STEP... 2>&1 | tee $OUT/suite.log
#
# Each result JSON carries its command, commit, configuration and machine (the harness,
# pdserve/benchlib/harness.py). To commit a run: copy its files to
# bench/results/<driver>/<set>/, delete the set it supersedes, then
# `python3 -m bench.results_md` (bench/RESULTS.md; a unit test fails while it is stale).
#
# Steps (results go to $OUT, named after the step; minutes are estimates on 2 x H200):
#   tests        pytest -m gpu tests/gpu (kernels, engine incl. async_decode, kvtransfer)  ~4
#   engine-tests pytest -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py  ~2
#   kernels      bench/kernels_gpu.py: every Triton kernel against its reference (1 GPU)   ~1
#   attn         bench/attention_prefill_gpu.py: prefill attention kernels per chunk shape  ~1
#   mixed        bench/mixed_step_gpu.py: a step of decode rows plus a prefill chunk, decode
#                rows through the decode kernel or with the chunk in one launch (1 GPU)    ~2
#   capacity     bench/prefill_capacity_gpu.py: prompt tokens/s of one prefill engine on the
#                disagg mix (1 GPU)                                                         ~2
#   sweep        bench/gemv_sweep.py: GEMV configs incl. split-K vs cuBLAS                ~3
#   sparsity     bench/sparsity_gpu.py: 2:4 sparse GEMMs (CUTLASS, cuSPARSELt) vs dense bf16
#                at Llama-3-8B prefill shapes, M 512/2048/8192 (1 GPU)                      ~1
#   gptq         bench/gptq_gpu.py: GPTQ rounding per Llama-3-8B projection and format, error
#                vs round-to-nearest, agreement with the CPU; then tests/gpu/test_gptq_gpu.py
#                (1 GPU)                                                                    ~2
#   fp8          issue 26's fp8 paths: tests/gpu/test_quant_gpu.py (f8mma, fused prologues,
#                graphs vs eager), bench/fp8_rows_gpu.py (2..8 rows: first tokens graphs vs
#                eager, f8mma vs _scaled_mm), bench/fp8_gemv_gpu.py (a8 / f8mma / weight-only / xq
#                at 1 row), then
#                bench/fp8_ab_gpu.py before / after (gpu_engine --defaults fp8 a, c, b) on the
#                same warm GPU (1 GPU)                                                       ~9
#   engine-a     bench/gpu_engine.py section a, 7 variants of split-K / PDL / async decode ~4
#   engine-best  bench/gpu_engine.py sections d,a,c,b with engine-a's fastest variant       ~3
#   engine-full  bench/gpu_engine.py sections d,a,c,b with FLAGS=... (and env)             ~3
#   kvcopy       bench/kv_copy_gpu.py: copy engines vs copy kernel for scattered blocks    ~1
#   transfer     bench/kv_transfer_gpu.py (2 GPUs)                                          ~3
#   defaults     bench/gpu_engine.py --defaults: bare LLM("dummy:llama-3-8b"), sections
#                a,c,e,b (issue 22's done-when), then tests/gpu/test_config_gpu.py           ~5
#   closed-loop  bench/closed_loop_engine.py: the engine alone at concurrency 512, all at once
#                vs closed loop (waves), then closed loop with spread arrivals (1500 x
#                (200 + 100..300)) in lockstep and launched ahead (1 GPU)                 ~3
#   served-gap   issue 22's served / offline ratio: bench/closed_loop_engine.py offline, then
#                pdserve bench --up per gateway transport (GAP_MODES: many per_request),
#                then offline again, per concurrency (GAP_C: 512), one colocated worker with
#                no flag but --device cuda (GAP_DEPLOY=1p1d: pdserve up's pair) (1 GPU)  ~2/run
#   serve-defaults  pdserve bench --up: one colocated worker with no flag but --device cuda
#                (Redis: the gateway learns its capacity), 1000 x (200+200) at concurrency
#                256 and 512; then 1P1D on the one GPU (pdserve up --device cuda)           ~8
#   xfer-sweep   bench/kv_transfer_gpu.py per backend setting (env): cuda_ipc copy lanes,
#                NCCL channel / chunk settings, NIXL descriptor size (2 GPUs)               ~4
#   xfer-tests   pytest -m gpu tests/gpu/test_kvtransfer_gpu.py (2 GPUs)                    ~2
#   openai       bench/openai_front_gpu.py: the OpenAI HTTP front vs gRPC, colocated
#                dummy:llama-3-8b, concurrency 64 and 256 (1 GPU)                          ~6
#   structured   bench/structured_gpu.py: the structured-output mask per decode step, batch
#                64 and 1, sampled then greedy (1 GPU; needs the llguidance wheel)          ~3
#   seeded       bench/seeded_batch_gpu.py: how often batch composition changes a seeded
#                sample (and a greedy one), dummy:llama-3-8b bf16 (1 GPU)                  ~3
#   disagg       bench/disagg_gpu.py nccl 1P1D vs colocated, rates 4,8,...,32 (2 GPUs)    ~8
#   ttft         bench/ttft_breakdown.py: where a 1P1D request's TTFT goes (2 GPUs)         ~1
#   ipc16        bench/disagg_gpu.py 1P1D only, 16 req/s, cuda_ipc then nccl (2 GPUs)      ~4
#   ttftgpu      bench/ttft_gpu.py: 1P1D set-ups vs colocated on the prefill GPU (2 GPUs)   ~4
#   goodput      bench/disagg_gpu.py at 20,22,24,26,28 req/s: where each keeps 90% (2 GPUs) ~6
#   p1d          bench/disagg_gpu.py, one deployment (DEPLOY, 1p1d) at P1D_RATES (24,26,28,30),
#                workers with WORKER_ARGS (1P1D prefill: PREFILL_ARGS, decode: DECODE_ARGS,
#                gateway: GATEWAY_ARGS), more flags P1D_EXTRA,
#                output ..._${DEPLOY}_$P1D_NAME.json (2 GPUs)                                ~3
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { echo "=== $*" >&2; "$@" || echo "=== FAILED ($?): $*" >&2; }
# engine-a variants: split-K GEMV configs in the tuner, PDL GEMV launches, async decode
variant_env() {
  local e="PDSERVE_GEMV_SPLIT_K=0 PDSERVE_GEMV_PDL=0"
  case $1 in *splitk*) e=${e/SPLIT_K=0/SPLIT_K=1} ;; esac
  case $1 in *pdl*) e=${e/PDL=0/PDL=1} ;; esac
  echo "$e"
}
variant_flags() { case $1 in *async*) echo --async-decode ;; *) echo --no-async-decode ;; esac; }
for step in "$@"; do
  case $step in
    tests) run python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider ;;
    engine-tests) run python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py \
        tests/gpu/test_engine_gpu.py -p no:cacheprovider ;;
    kernels) run python3 -m bench.kernels_gpu --out "$OUT/kernels_gpu_h200.json" ;;
    structured)  # SmolLM2-135M's vocabulary and shapes, zero weights (scripts/zero_model.py)
      m=${STRUCTURED_MODEL:-/tmp/smollm2-135m-zero}
      run python3 -m bench.structured_gpu --model "$m" --out "$OUT/structured_gpu_h200.json"
      run python3 -m bench.structured_gpu --model "$m" --temperature 0 --batches 64 \
        --out "$OUT/structured_gpu_h200_greedy.json" ;;
    seeded) run python3 -m bench.seeded_batch_gpu --out "$OUT/seeded_batch_gpu.json" ;;
    kvcopy) run python3 -m bench.kv_copy_gpu --out "$OUT/kv_copy_gpu_h200.json" ;;
    attn) run python3 -m bench.attention_prefill_gpu --out "$OUT/attention_prefill_gpu_h200.json" ;;
    mixed) run python3 -m bench.mixed_step_gpu ${MIXED_ARGS:-} \
        --out "$OUT/mixed_step_gpu_h200${MIXED_NAME:-}.json" ;;
    capacity) run python3 -m bench.prefill_capacity_gpu ${CAPACITY_ARGS:-} \
        --out "$OUT/prefill_capacity_gpu_h200.json" ;;
    sweep) run python3 -m bench.gemv_sweep --out "$OUT/gemv_sweep_h200.json" ;;
    sparsity) run python3 -m bench.sparsity_gpu --out "$OUT/sparsity_gpu_h200.json" ;;
    gptq) run python3 -m bench.gptq_gpu --out "$OUT/gptq_gpu_h200.json"
      run python3 -m pytest -q -m gpu tests/gpu/test_gptq_gpu.py -p no:cacheprovider ;;
    fp8) run python3 -m pytest -v -m gpu tests/gpu/test_quant_gpu.py -p no:cacheprovider \
        -k "fp8 or fused_prologue or tensor_core"
      run python3 -m bench.fp8_rows_gpu > "$OUT/fp8_rows_gpu.log"
      run python3 -m bench.fp8_gemv_gpu --rows 1 --rounds 3 --variants a8,f8mma,wo,xq \
        --out "$OUT/fp8_gemv_gpu.json"
      for v in before after; do
        run python3 -m bench.fp8_ab_gpu $v --defaults --quantization fp8 --sections a,c,b \
          --out "$OUT/gpu_engine_fp8_$v.json"
      done ;;
    engine-a)  # section a only, few graph buckets; one process per variant
      for v in base splitk pdl async splitk_pdl pdl_async splitk_pdl_async; do
        env $(variant_env $v) python3 -m bench.gpu_engine --sections a --max-num-seqs 8 \
          $(variant_flags $v) --out "$OUT/gpu_engine_a_$v.json" \
          || echo "=== FAILED: engine-a $v" >&2
      done ;;
    engine-best)  # the full run (d, a, c, b) with the engine-a variant of highest decode tok/s
      v=$(python3 - "$OUT" <<'PY'
import glob, json, os, sys
best = max(((json.load(open(f))["a"]["decode_tok_s_median"], f) for f in
            glob.glob(os.path.join(sys.argv[1], "gpu_engine_a_*.json"))), default=(0, "base"))
print(os.path.basename(best[1])[len("gpu_engine_a_"):-len(".json")] if best[0] else "base")
PY
)
      echo "=== engine-best: variant $v" >&2
      env $(variant_env $v) python3 -m bench.gpu_engine --sections d,a,c,b $(variant_flags $v) \
        --out "$OUT/gpu_engine_h200.json" || echo "=== FAILED: engine-best $v" >&2 ;;
    engine-full) run python3 -m bench.gpu_engine --sections d,a,c,b ${FLAGS:-} \
        --out "$OUT/gpu_engine_h200.json" ;;
    defaults) run python3 -m bench.gpu_engine --defaults \
        --out "$OUT/gpu_engine_defaults_h200.json"
      run python3 -m pytest -q -m gpu tests/gpu/test_config_gpu.py -p no:cacheprovider ;;
    closed-loop)
      run python3 -m bench.closed_loop_engine --model dummy:llama-3-8b --device cuda \
        --concurrency 512 --modes offline,closed --out "$OUT/closed_loop_c512.json"
      for v in "ahead|" "lockstep|--engine-arg async_decode=false"; do
        run python3 -m bench.closed_loop_engine --model dummy:llama-3-8b --device cuda \
          --concurrency 512 --num-requests 1500 --output-len 100:300 --arrival-delay-ms 2 \
          --modes closed ${v#*|} --out "$OUT/closed_loop_spread_${v%%|*}.json"
      done ;;
    serve-defaults)  # the LLM.generate figure to compare with: engine-full / defaults, b
      for dep in "colocated:--colocated 1 --prefill 0 --decode 0" "1p1d:--prefill 1 --decode 1"; do
        for c in 256 512; do
          run python3 -m pdserve.cli bench --up ${dep#*:} --model dummy:llama-3-8b --device cuda \
            --prompt-format tokens --vocab-size 128000 --input-len 200:200 \
            --output-len 200:200 --num-requests 1000 --warmup 64 --concurrency $c \
            --no-plots --no-progress --out "$OUT/serving_defaults_h200_${dep%%:*}_c$c.json"
        done
      done ;;
    openai) run python3 -m bench.openai_front_gpu --out "$OUT/openai_front_gpu.json" ;;
    xfer-tests) run python3 -m pytest -q -m gpu tests/gpu/test_kvtransfer_gpu.py \
        tests/gpu/test_kvtransfer_gpu_checks.py \
        -p no:cacheprovider ;;
    xfer-sweep)  # one process pair per setting; "name|backend|env"
      for spec in ${XFER_SWEEP:-"ipc_l1|cuda_ipc|PDSERVE_CUDA_IPC_LANES=1" \
          "ipc_l2|cuda_ipc|PDSERVE_CUDA_IPC_LANES=2" "ipc_l4|cuda_ipc|PDSERVE_CUDA_IPC_LANES=4" \
          "nccl_base|nccl|" "nccl_ch32|nccl|NCCL_MIN_NCHANNELS=32,NCCL_MIN_P2P_NCHANNELS=32" \
          "nccl_chunk|nccl|NCCL_P2P_NVL_CHUNKSIZE=2097152,NCCL_BUFFSIZE=16777216" \
          "nccl_memcpy|nccl|NCCL_P2P_USE_CUDA_MEMCPY=1" "nixl_d0|nixl|" \
          "nixl_d128m|nixl|PDSERVE_NIXL_MAX_DESCRIPTOR_BYTES=134217728" \
          "nixl_d32m|nixl|PDSERVE_NIXL_MAX_DESCRIPTOR_BYTES=33554432"}; do
        IFS='|' read -r name backend envs <<<"$spec"
        echo "=== xfer-sweep $name: $backend ${envs//,/ }" >&2
        env ${envs//,/ } PDSERVE_KV_TIMELINE=1 timeout 120 python3 -m bench.kv_transfer_gpu \
          --backends "$backend" --modes send,ahead --runs ${XFER_RUNS:-10} \
          --out "$OUT/kv_transfer_gpu_h200_$name.json" 2>"$OUT/kv_timeline_$name.log" \
          || echo "=== FAILED: xfer-sweep $name" >&2
      done
      # the device tool returns at most 8 files: one archive for the whole sweep
      (cd "$OUT" && tar -czf xfer_sweep.tgz kv_transfer_gpu_h200_*.json kv_timeline_*.log \
        && rm -f kv_transfer_gpu_h200_*.json kv_timeline_*.log) ;;
    transfer) PDSERVE_KV_TIMELINE=1 run python3 -m bench.kv_transfer_gpu \
        --out "$OUT/kv_transfer_gpu_h200.json" ;;
    disagg) run python3 -m bench.disagg_gpu --kv-backend nccl,cuda_ipc \
        --colocated-kv-backend nccl --time-budget 540 --out "$OUT/disagg_gpu_h200_nccl.json" ;;
    ttft) run python3 -m bench.ttft_breakdown --devices gpu --kv-backend nccl,cuda_ipc \
        --out "$OUT/ttft_breakdown_h200.json" ;;
    ipc16) run python3 -m bench.disagg_gpu --deployments 1p1d --rates 16 \
        --kv-backend cuda_ipc,nccl --out "$OUT/disagg_gpu_h200_cuda_ipc_16.json" ;;
    ttftgpu) run python3 -m bench.ttft_gpu --rounds 2 --configs \
        ${TTFT_CONFIGS:-coloc@0,1p1d@0:nccl,1p1d@0:cuda_ipc,coloc@1,1p1d@1:nccl} \
        --out "$OUT/ttft_gpu_h200.json" ;;
    goodput) run python3 -m bench.disagg_gpu --kv-backend nccl,cuda_ipc \
        --colocated-kv-backend nccl --rates 20,22,24,26,28 --exact-prompts 4 --time-budget 560 \
        --out "$OUT/disagg_gpu_h200_goodput_grid.json" ;;
    p1d)  # one deployment (DEPLOY: 1p1d) near its SLO limit; PREFILL_ARGS: the 1P1D prefill
          # worker's extra flags, WORKER_ARGS: every worker's
      run python3 -m bench.disagg_gpu --deployments ${DEPLOY:-1p1d} --kv-backend nccl,cuda_ipc \
        --colocated-kv-backend nccl --rates ${P1D_RATES:-24,26,28,30} --exact-prompts 4 \
        --ttft-repeats 4 ${PREFILL_ARGS:+--prefill-worker-args "$PREFILL_ARGS"} \
        ${WORKER_ARGS:+--worker-args "$WORKER_ARGS"} ${GATEWAY_ARGS:+--gateway-args "$GATEWAY_ARGS"} \
        ${DECODE_ARGS:+--decode-worker-args "$DECODE_ARGS"} ${P1D_EXTRA:-} \
        --out "$OUT/disagg_gpu_h200_${DEPLOY:-1p1d}_${P1D_NAME:-p1d}.json" ;;
    served-gap)  # issue 22: LLM.generate and served runs alternating on one warm GPU, per
                 # concurrency in GAP_C; served runs per gateway transport in GAP_MODES
                 # (many: GenerateMany, one stream per worker; per_request: one Generate call
                 # each); GAP_DEPLOY colocated or 1p1d (1p1d skips the offline runs)
      dep_flags="--colocated 1 --prefill 0 --decode 0"
      [ "${GAP_DEPLOY:-colocated}" = 1p1d ] && dep_flags="--prefill 1 --decode 1"
      for c in ${GAP_C:-512}; do
        i=0
        offline() {
          [ "${GAP_DEPLOY:-colocated}" = 1p1d ] && return
          i=$((i + 1))
          run timeout 120 python3 -m bench.closed_loop_engine --model dummy:llama-3-8b \
            --device cuda --concurrency $c --modes offline --out "$OUT/offline_c${c}_$i.json"
        }
        offline
        for mode in ${GAP_MODES:-many per_request}; do
          i=$((i + 1))
          run env PDSERVE_DECODE_STREAM=$mode timeout 200 python3 -m pdserve.cli bench --up $dep_flags \
            --model dummy:llama-3-8b --device cuda --prompt-format tokens --vocab-size 128000 \
            --input-len 200:200 --output-len 200:200 --num-requests 1000 --warmup 64 \
            --concurrency $c --no-plots --no-progress \
            --out "$OUT/served_${GAP_DEPLOY:-colocated}_c${c}_${mode}_$i.json"
        done
        offline
      done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
