#!/bin/bash
# The bundled model's unlikelihood fine-tune and its measurements in one GPU call (MODEL_CARD.md):
#   1. `specfire train --preset bundled-ul --init specfire/bundled`: UL phase from the shipped weights
#      (snapshots packed as ul-1.tar / ul-2.tar, the final as model.tar, 15 MB parts, into $OUT);
#   2. bench/bundled_ppl.py: the first bundled model, the shipped one and the new one on the same
#      held-out text (GPU);
#   3. bench/bundled_cpu.py: `specfire run` decode speed on this host's CPU, pinned to 2 cores
#      (2 threads, AR) and to 1 core (1 thread: AR, MTP k=3, auto), new model then the shipped one.
# Everything printed goes to $OUT/log.txt. DRY=1 runs the same steps tiny on the CPU (a smoke test).
# Run once, at commit 2883089 (253.5 s on an H200), when the sequence-level loss was the plain
# -log(1 - p) one: the result degenerated (MODEL_CARD.md). The trainer now defaults to the anchored
# loss (ul_seq_anchor), which this script would use as it stands; that has not been run on a GPU.
#   OUT=/tmp/out OLD1=old1 bash bench/bundled_ul_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bundled-ul-out}
OLD1=${OLD1:-old1}                      # the first bundled model's checkpoint (from git history)
INIT=${INIT:-specfire/bundled}
CK=${CK:-/tmp/ck-ul}
PY=${PY:-python}
mkdir -p "$OUT"
LOG=$OUT/log.txt
if [ "${DRY:-0}" = 1 ]; then
  TRAIN=(--preset tiny --device cpu --max-files 25 --seq-len 64 --eval-windows 2 --ul-steps 3 --ul-pool 8
         --ul-batch 4 --ul-data-batch 2 --ul-new-tokens 24 --ul-prompt-min 8 --ul-prompt-max 12 --ul-eval-prompts 4
         --ul-snapshots 2)
  PPL=(--device cpu --max-bytes 20000 --accept-windows 2 --batch 4)
  CPU_NEW=(--reps 1 -n 8); CPU_REF=(--reps 1 -n 8)
else
  TRAIN=(--preset bundled-ul --max-train-bytes 64000000 --ul-time-s 140)
  PPL=(--device cuda --batch 32 --accept-windows 128)
  CPU_NEW=(--reps 3 -n 128); CPU_REF=(--reps 1 -n 128)   # one repeat for the shipped model (the reference)
fi
stamp() { echo "=== $(date +%T) [$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
T0=$(date +%s)
stamp "host: $(nproc) CPUs; $(lscpu 2>/dev/null | grep -m1 'Model name' | sed 's/  */ /g')"
stamp "train"
$PY -m specfire train --init "$INIT" --out "$CK" --pack-dir "$OUT" "${TRAIN[@]}" >> "$LOG" 2>&1
echo "train rc=$?" | tee -a "$LOG"
stamp "held-out perplexity: first model, shipped model, new model"
$PY bench/bundled_ppl.py --models "$OLD1,$INIT,$CK" "${PPL[@]}" >> "$LOG" 2>&1
echo "ppl rc=$?" | tee -a "$LOG"
CPU=("${CPU_NEW[@]}")
for model in "$CK" "$INIT"; do
  stamp "CPU speed of $model: taskset -c 0,1, 2 threads"
  taskset -c 0,1 $PY bench/bundled_cpu.py --model "$model" --plan "2:off" "${CPU[@]}" \
    --label "GPU host CPU, taskset -c 0,1" >> "$LOG" 2>&1
  stamp "CPU speed of $model: taskset -c 0, 1 thread"
  taskset -c 0 $PY bench/bundled_cpu.py --model "$model" --plan "1:off,mtp,auto" "${CPU[@]}" \
    --label "GPU host CPU, taskset -c 0" >> "$LOG" 2>&1
  CPU=("${CPU_REF[@]}")
done
stamp "done"
