#!/usr/bin/env bash
# Where a serving worker's host time goes: pdserve bench --up against one colocated worker on
# the GPU (no flag but --device cuda), py-spy (carried in .whl/bin) sampling the worker and the
# gateway for PROFILE_S seconds mid-run; collapsed stacks (one line per stack: frames;count)
# land in $OUT for offline reading.
#   source scripts/device_env.sh && CONC=512 bash bench/serve_profile_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; CONC=${CONC:-512}; PROFILE_S=${PROFILE_S:-8}
python3 -m pdserve.cli bench --up --colocated 1 --prefill 0 --decode 0 --model dummy:llama-3-8b \
  --device cuda --prompt-format tokens --vocab-size 128000 --input-len 200:200 \
  --output-len 200:200 --num-requests ${REQUESTS:-2000} --warmup 64 --concurrency $CONC \
  --no-plots --no-progress --out "$OUT/serve_profile_c$CONC.json" > "$OUT/serve_profile.log" 2>&1 &
bench=$!
for _ in $(seq 120); do  # until the measured requests run (the warm-up is over)
  grep -q "up in" "$OUT/serve_profile.log" 2>/dev/null && break; sleep 1
done
sleep ${PROFILE_AFTER_S:-12}
worker=$(pgrep -f "pdserve.cli colocated" | head -1)
gateway=$(pgrep -f "pdserve.cli gateway" | head -1)
py-spy record -d "$PROFILE_S" -r 200 --format raw --threads -o "$OUT/worker_stacks.txt" --pid "$worker" &
w=$!
py-spy record -d "$PROFILE_S" -r 200 --format raw --threads -o "$OUT/gateway_stacks.txt" --pid "$gateway" &
g=$!
wait $w $g
wait $bench
grep "== " "$OUT/serve_profile.log"
