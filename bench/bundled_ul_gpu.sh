#!/bin/bash
# The bundled model's unlikelihood fine-tune and its held-out perplexity in one short GPU call
# (MODEL_CARD.md, "The unlikelihood fine-tune"):
#   1. `specfire train --preset bundled-ul --init specfire/bundled`: the UL phase alone from the
#      shipped weights, with the anchored target that bans every repeat-completing token
#      (ul_seq_ban, the default), on CORPUS (site: a path-hash sample of MAX_BYTES of the pretraining
#      corpus, read in seconds), a KL-to-start term on the corpus batches, and snapshot selection
#      (ul_select, select.py): every snapshot is scored on the repetition benchmark's prompts and
#      on held-out perplexity, and the rule fixed beforehand picks the weights that are exported:
#      among snapshots whose WHOLE-text held-out-packages perplexity (bench/bundled_ppl.py's figure) is
#      <= 1.05x the shipped model's, the lowest guarded repeated-line share over the loop bench's 12
#      prompts and 32 held-out-package prompts pooled (both sets are also logged apart).
#      The chosen weights are packed as model.tar.partNN into $OUT (the last ones as last.tar.partNN
#      when the rule picked an earlier snapshot);
#   2. bench/bundled_ppl.py: the shipped model and the chosen one on the same held-out text (GPU),
#      JSON into $OUT/ppl.json, in whatever is left of BUDGET seconds.
# The greedy repetition (bench/bundled_loops.py) and MTP acceptance (bench/bundled_accept.py) are
# then measured on a CPU, on the unpacked weights (they run the engine's CPU path).
# Everything printed goes to $OUT/log.txt. DRY=1 runs the same steps tiny on the CPU (a smoke test).
# SHIPPING RULE (fixed before the 2026-11-30 fourth try): the snapshot the rule above exports replaces
# specfire/bundled only if ALSO, measured on it afterwards on the CPU: (a) guarded repetition on the
# 12 bench prompts <= 25% (bench/bundled_loops.py); (b) greedy MTP output == AR output and MTP k=3
# mean accept >= 2.5 (bench/bundled_accept.py); (c) its 12 bench completions, read by a person, hold
# no mangled or invented identifiers. No snapshot within the perplexity budget, or any check failing:
# nothing ships (the card says what was measured).
# Runs (MODEL_CARD.md): 2026-11-30, commit 83f5670, H200, 106.9 s, stdlib corpus, no KL, no selection;
#   2026-11-30, commit 7fd9d29, H200, 115.9 s: `OUT=$OUT BUDGET=143 UL_TIME=75 bash bench/bundled_ul_gpu.sh`
#   (those settings: KL 1, every 4th window, no word edges, rule on the 12 bench prompts): loop bench
#   76.7% -> 14.1%, held-out ppl +4.97% (the rule's sample: +5.1%: none chosen);
#   2026-11-30, commit ce2ee8b, H200, 113.5 s, fourth try (these defaults):
#   `OUT=$OUT BUDGET=118 UL_TIME=66 bash bench/bundled_ul_gpu.sh`: 81 steps, the rule chose step 66 (pooled
#   30.2%, ppl +4.7%); loop bench 76.7% -> 34.8% (> 25%): not shipped.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bundled-ul-out}
INIT=${INIT:-specfire/bundled}
CK=${CK:-/tmp/ck-ul}
PY=${PY:-python}
UL_TIME=${UL_TIME:-80}
CORPUS=${CORPUS:-site}                  # site: the pretraining corpus, sampled to MAX_BYTES; stdlib: 10 MB,
MAX_BYTES=${MAX_BYTES:-24000000}        #   which the phase overfits (MODEL_CARD.md)
mkdir -p "$OUT"
LOG=$OUT/log.txt
# 8-gram bans (87% of the repeated lines of the second run's completions hold a token inside a repeated
# 8-gram; 3.5% of real held-out code's tokens complete one, 5.6% at 6), sequence term weight 2; the
# fourth try: no ban on a token that continues a word (--ul-word-bans 1: the third try escaped repeats
# by misspelling names), KL 2 instead of 1 (perplexity margin), the rule on the whole held-out text
# (--ul-ppl-every 1) and on the bench + held-out prompts pooled.
UL=(--ul-lr 5e-4 --ul-warmup 5 --ul-token-weight 0 --ul-ngram 8 --ul-seq-weight 2 --ul-kl-weight 2
    --ul-word-bans 1 --ul-snapshots 4 --ul-select 1 --ul-ppl-budget 0.05 --ul-ppl-every 1 --ul-select-tokens 160)
if [ "${DRY:-0}" = 1 ]; then
  TRAIN=(--preset bundled-ul --corpus "$CORPUS" --max-train-bytes "${DRY_BYTES:-1000000}" --device cpu
         --eval-windows 2 --ul-steps 5 --ul-pool 8 --ul-batch 4 --ul-data-batch 2 --ul-new-tokens 24 --ul-prompt-min 8
         --ul-prompt-max 12 --ul-eval-prompts 4 --seq-len 64 --ul-probe-steps 1)
  UL+=(--ul-select-tokens 16 --ul-ppl-every 400)     # (the last of a repeated option wins)
  PPL=(--device cpu --max-bytes 20000 --accept-windows 2 --batch 4)
else
  TRAIN=(--preset bundled-ul --corpus "$CORPUS" --max-train-bytes "$MAX_BYTES" --ul-time-s "$UL_TIME" --eval-windows 64
         --ul-pool 1024 --ul-batch 64 --ul-data-batch 32 --ul-new-tokens 128 --ul-prompt-min 16 --ul-prompt-max 32
         --ul-eval-prompts 32)
  PPL=(--device cuda --batch 32 --accept-windows 128)
fi
stamp() { echo "=== $(date +%T) [$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
T0=$(date +%s)
stamp "host: $(nproc) CPUs; $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>&1)"
stamp "train"
$PY -m specfire train --init "$INIT" --out "$CK" --pack-dir "$OUT" "${TRAIN[@]}" "${UL[@]}" >> "$LOG" 2>&1
RC=$?
echo "train rc=$RC" | tee -a "$LOG"
[ "$RC" = 0 ] || { stamp "training failed: no perplexity run"; exit "$RC"; }
stamp "held-out perplexity: shipped model, new model"
PPL_LIMIT=600                                   # BUDGET: the whole call's seconds; the bench gets what is left
[ -n "${BUDGET:-}" ] && PPL_LIMIT=$(( BUDGET - ($(date +%s) - T0) ))
timeout "$PPL_LIMIT" $PY bench/bundled_ppl.py --models "$INIT,$CK" "${PPL[@]}" --json "$OUT/ppl.json" >> "$LOG" 2>&1
echo "ppl rc=$?" | tee -a "$LOG"
stamp "done"
