#!/bin/bash
# The bundled model's unlikelihood fine-tune and its held-out perplexity in one short GPU call
# (MODEL_CARD.md, "The unlikelihood fine-tune"):
#   1. `specfire train --preset bundled-ul --init specfire/bundled`: the UL phase alone from the
#      shipped weights, with the anchored target that bans every repeat-completing token
#      (ul_seq_ban, the default), on CORPUS (site: a path-hash sample of MAX_BYTES of the pretraining
#      corpus, read in seconds), a KL-to-start term on the corpus batches, then (ANNEAL s) a phase of
#      likelihood + MTP + KL only, and snapshot selection (ul_select, select.py): every snapshot of both
#      phases is scored on a VALIDATION set (training-corpus files set aside from the phase) and the
#      rule fixed beforehand picks the weights that are exported: among snapshots whose validation
#      perplexity is <= 1.05x the start, the lowest guarded repeated-line share on 64 validation
#      prompts. The loop bench's 12 prompts, 32 held-out-package prompts and the held-out perplexity
#      are logged beside it, never used by the rule. The chosen weights are packed as model.tar.partNN
#      into $OUT (the last ones as last.tar.partNN when the rule picked an earlier snapshot);
#   2. bench/bundled_ppl.py: the shipped model and the chosen one on the same held-out text (GPU),
#      JSON into $OUT/ppl.json, in whatever is left of BUDGET seconds.
# The greedy repetition (bench/bundled_loops.py) and MTP acceptance (bench/bundled_accept.py) are
# then measured on a CPU, on the unpacked weights (they run the engine's CPU path).
# Everything printed goes to $OUT/log.txt. DRY=1 runs the same steps tiny on the CPU (a smoke test).
# SHIPPING RULE (fixed 2026-12-01 before the fifth try; the fourth try's rule used the bench and held-out
# prompts to pick the snapshot, which this one never does): the trainer's rule picks, among the snapshots
# of both phases, the lowest guarded repetition on 64 VALIDATION prompts (training-corpus files set aside
# from the phase: corpus.split_validation) with validation-file perplexity <= 1.05x the start. That pick
# (and no other) replaces specfire/bundled only if ALSO: (a) guarded repetition on the 12 bench prompts
# <= 25% (bench/bundled_loops.py, CPU); (b) guarded repetition on the 32 held-out-package prompts <= 30%
# (the trainer's log, GPU fp32 rollout with the bench's measure); (c) held-out packages perplexity,
# whole text (bench/bundled_ppl.py), <= +6% over the shipped model's (and so still >= 30% below the
# original model's); (d) greedy MTP == AR and MTP k=3 mean accept >= 2.5 (bench/bundled_accept.py, CPU);
# (e) its 12 bench completions, read by a person, hold no mangled or invented names and no phrase looping
# inside a line. Any check failing: nothing ships (the card says what was measured).
# Runs (MODEL_CARD.md): 2026-11-30, commit 83f5670, H200, 106.9 s, stdlib corpus, no KL, no selection;
#   2026-11-30, commit 7fd9d29, H200, 115.9 s, third try (rule on the 12 bench prompts + held-out ppl):
#   loop bench 76.7% -> 14.1%, held-out ppl +4.97% (the rule's sample: +5.1%: none chosen);
#   2026-11-30, commit ce2ee8b, H200, 113.5 s, fourth try (rule on bench + held-out prompts pooled):
#   the rule chose step 66 (pooled 30.2%, ppl +4.7%); loop bench 34.8% (> 25%): not shipped;
#   2026-12-01, commit 96535be, H200, 328.8 s, fifth try (these defaults, the validation rule):
#   `OUT=$OUT BUDGET=348 UL_TIME=225 ANNEAL=45 bash bench/bundled_ul_gpu.sh`: 293 UL + 143 anneal steps; the
#   rule chose step 252 (validation 20.0%, ppl x1.048); bench 21.4%, held-out prompts 17.3%, held-out ppl
#   +4.0%, but phrase loops inside lines (check (e)): not shipped. The anneal brought the loops back (54%).
#   2026-12-01, commit edb8038, H200, 296.8 s, sixth try: `OUT=$OUT BUDGET=322 UL_TIME=255 ANNEAL=0 LINE_NGRAM=4
#   SELECT_PHRASE=2 SEQ_WEIGHT=3 SNAPSHOTS=6 bash bench/bundled_ul_gpu.sh`: 415 UL steps; the rule chose the last
#   (validation 22.3% + 2 x 4.6% phrase, ppl x1.045); bench 20.2%, held-out prompts 24.4%, ppl +3.7%, accept 3.34,
#   but phrase-loop lines 8.7% (> 2%, check (e) made numeric): not shipped.
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
# 8-gram; 3.5% of real held-out code's tokens complete one, 5.6% at 6), sequence term weight 2, no ban on a
# token that continues a word (--ul-word-bans 1: the third try escaped repeats by misspelling names).
# Fifth try: KL 1 (the third try's; KL 2 held repetition back), a UL phase of UL_TIME s whose cosine stops
# at 0.4 x lr (repetition rose as the lr fell), then ANNEAL s of LM + MTP + KL only (lr 2e-4 -> 0) to win
# back perplexity; 160-token rollouts (the measure's length) from 8-32-token prompts; the rule on the
# validation set (64 prompts, its own perplexity); bench and held-out figures logged only.
ANNEAL=${ANNEAL:-45}
LINE_NGRAM=${LINE_NGRAM:-0}             # > 0: also ban in-line repeats of this many tokens (phrase loops; off in the fifth try)
SELECT_PHRASE=${SELECT_PHRASE:-0}       # the rule's figure adds this x the phrase-loop line share (0 in the fifth try)
SEQ_WEIGHT=${SEQ_WEIGHT:-2}             # the sequence-unlikelihood term's weight (2 in the third to fifth tries)
SNAPSHOTS=${SNAPSHOTS:-5}               # scored snapshots of the UL phase (5 in the fifth try)
UL=(--ul-lr 5e-4 --ul-warmup 5 --ul-min-lr-frac 0.4 --ul-token-weight 0 --ul-ngram 8 --ul-seq-weight "$SEQ_WEIGHT"
    --ul-kl-weight 1 --ul-word-bans 1 --ul-snapshots "$SNAPSHOTS" --ul-select 1 --ul-ppl-budget 0.05 --ul-ppl-every 1
    --ul-select-tokens 160 --ul-val-permille 30 --ul-val-prompts 64 --ul-anneal-lr 2e-4 --ul-anneal-snapshots 3
    --ul-line-ngram "$LINE_NGRAM" --ul-select-phrase "$SELECT_PHRASE")
if [ "${DRY:-0}" = 1 ]; then
  TRAIN=(--preset bundled-ul --corpus "$CORPUS" --max-train-bytes "${DRY_BYTES:-1000000}" --device cpu
         --eval-windows 2 --ul-steps 5 --ul-pool 8 --ul-batch 4 --ul-data-batch 2 --ul-new-tokens 24 --ul-prompt-min 8
         --ul-prompt-max 12 --ul-eval-prompts 4 --seq-len 64 --ul-probe-steps 1 --ul-anneal-steps "$( [ "$ANNEAL" = 0 ] && echo 0 || echo 3 )")
  UL+=(--ul-select-tokens 16 --ul-ppl-every 400 --ul-val-permille 100 --ul-val-prompts 4)   # (the last of a repeated option wins)
  PPL=(--device cpu --max-bytes 20000 --accept-windows 2 --batch 4)
else
  TRAIN=(--preset bundled-ul --corpus "$CORPUS" --max-train-bytes "$MAX_BYTES" --ul-time-s "$UL_TIME" --eval-windows 64
         --ul-pool 1024 --ul-batch 64 --ul-data-batch 32 --ul-new-tokens 160 --ul-prompt-min 8 --ul-prompt-max 32
         --ul-eval-prompts 32 --ul-anneal-s "$ANNEAL")
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
timeout "$PPL_LIMIT" $PY -m bench.bundled_ppl --models "$INIT,$CK" "${PPL[@]}" --json "$OUT/ppl.json" >> "$LOG" 2>&1
echo "ppl rc=$?" | tee -a "$LOG"
stamp "done"
