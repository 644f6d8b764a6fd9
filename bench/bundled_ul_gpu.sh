#!/bin/bash
# The bundled model's unlikelihood fine-tune and its held-out perplexity in one short GPU call
# (MODEL_CARD.md, "The unlikelihood fine-tune"):
#   1. `specfire train --preset bundled-ul --init specfire/bundled`: the UL phase alone from the
#      shipped weights, on the standard-library corpus (loads in seconds), with the anchored
#      target that bans every repeat-completing token (ul_seq_ban, the default); one mid-phase
#      snapshot packed as ul-1.tar.partNN and the final weights as model.tar.partNN into $OUT;
#   2. bench/bundled_ppl.py: the shipped model and the new one on the same held-out text (GPU),
#      JSON into $OUT/ppl.json.
# The greedy repetition (bench/bundled_loops.py) and MTP acceptance (bench/bundled_accept.py) are
# measured afterwards on a CPU, on the unpacked weights (they run the engine's CPU path).
# Everything printed goes to $OUT/log.txt. DRY=1 runs the same steps tiny on the CPU (a smoke test).
# Run once (2026-11-30, commit 83f5670, H200, 106.9 s) as `OUT=$OUT BUDGET=143 bash bench/bundled_ul_gpu.sh`
# with the stdlib corpus: results and the next call in MODEL_CARD.md.
#   OUT=/tmp/out BUDGET=145 [CORPUS=site UL_TIME=60] bash bench/bundled_ul_gpu.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bundled-ul-out}
INIT=${INIT:-specfire/bundled}
CK=${CK:-/tmp/ck-ul}
PY=${PY:-python}
UL_TIME=${UL_TIME:-70}
CORPUS=${CORPUS:-stdlib}                # site: the pretraining corpus (+~25 s of preparation), subsampled to
MAX_BYTES=${MAX_BYTES:-32000000}        #   MAX_BYTES; stdlib: 10 MB, which the phase overfits (MODEL_CARD.md)
mkdir -p "$OUT"
LOG=$OUT/log.txt
UL=(--ul-lr 5e-4 --ul-warmup 5 --ul-token-weight 0 --ul-ngram 8 --ul-snapshots 1)
if [ "${DRY:-0}" = 1 ]; then
  TRAIN=(--preset bundled-ul --corpus stdlib --device cpu --max-files 25 --eval-windows 2 --ul-steps 3 --ul-pool 8
         --ul-batch 4 --ul-data-batch 2 --ul-new-tokens 24 --ul-prompt-min 8 --ul-prompt-max 12 --ul-eval-prompts 4
         --seq-len 64)
  PPL=(--device cpu --max-bytes 20000 --accept-windows 2 --batch 4)
else
  TRAIN=(--preset bundled-ul --corpus "$CORPUS" --max-train-bytes "$MAX_BYTES" --ul-time-s "$UL_TIME" --eval-windows 64 --ul-pool 1024
         --ul-batch 64 --ul-data-batch 64 --ul-new-tokens 128 --ul-prompt-min 16 --ul-prompt-max 32
         --ul-eval-prompts 64)
  PPL=(--device cuda --batch 32 --accept-windows 128)
fi
stamp() { echo "=== $(date +%T) [$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
T0=$(date +%s)
stamp "host: $(nproc) CPUs; $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>&1)"
stamp "train"
$PY -m specfire train --init "$INIT" --out "$CK" --pack-dir "$OUT" "${TRAIN[@]}" "${UL[@]}" >> "$LOG" 2>&1
echo "train rc=$?" | tee -a "$LOG"
stamp "held-out perplexity: shipped model, new model"
PPL_LIMIT=600                                   # BUDGET: the whole call's seconds; the bench gets what is left
[ -n "${BUDGET:-}" ] && PPL_LIMIT=$(( BUDGET - ($(date +%s) - T0) ))
timeout "$PPL_LIMIT" $PY bench/bundled_ppl.py --models "$INIT,$CK" "${PPL[@]}" --json "$OUT/ppl.json" >> "$LOG" 2>&1
echo "ppl rc=$?" | tee -a "$LOG"
stamp "done"
