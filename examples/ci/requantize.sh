#!/usr/bin/env bash
# Re-quantize a fine-tune (base model + LoRA adapter) into gated release artifacts.
#
#   MODEL=./base ADAPTER=./adapter OUT=./dist examples/ci/requantize.sh [extra quantkit flags]
#
# Environment (all but MODEL optional):
#   MODEL     base model: a local checkpoint directory, or a Hub id org/name@revision (fetched into HF_HOME)
#   ADAPTER   LoRA adapter directory merged into the base first (empty: none)
#   OUT       output directory, kept between runs (a CI cache): default dist
#   RECIPE    bundled recipe name or YAML file: default release (FP8 + AWQ W4A16 + GGUF Q4_K_M)
#   REPORT    JSON report of the run: default quantkit-report.json
#   SUMMARY   Markdown gate table is appended here: default $GITHUB_STEP_SUMMARY, else quantkit-summary.md
#   QUANTKIT  the command: default "python -m quantkit"
#
# Targets whose output in OUT is up to date (same inputs, recipe and quantkit version) are skipped;
# the others are re-run, and each one that passes its gate replaces its old output (--partial).
# Exit status is quantkit's: 0 ok, 1 internal error, 2 bad input, 3 a quality gate failed.
set -euo pipefail

: "${MODEL:?set MODEL to the base model directory}"
ADAPTER="${ADAPTER:-}"
OUT="${OUT:-dist}"
RECIPE="${RECIPE:-release}"
REPORT="${REPORT:-quantkit-report.json}"
SUMMARY="${SUMMARY:-${GITHUB_STEP_SUMMARY:-quantkit-summary.md}}"
QUANTKIT="${QUANTKIT:-python -m quantkit}"

args=(quantize "$MODEL" --recipe "$RECIPE" -o "$OUT" --skip-existing --partial --quiet
      --json "$REPORT" --summary "$SUMMARY")
if [ -n "$ADAPTER" ]; then
    args+=(--lora "$ADAPTER")
fi

rm -f "$REPORT"
status=0
$QUANTKIT "${args[@]}" "$@" || status=$?

if [ "$status" -ne 0 ] && [ ! -f "$REPORT" ]; then
    # failed before any target ran (bad input, missing model, ...): say so in the job summary too
    echo "**quantkit failed (exit $status) before quantizing; see the job log.**" >> "$SUMMARY"
fi
case "$status" in
    0) echo "requantize: $OUT is up to date" ;;
    3) echo "requantize: a quality gate failed (the table is in $SUMMARY); the targets that passed are in $OUT" >&2 ;;
    *) echo "requantize: quantkit failed with exit code $status" >&2 ;;
esac
exit "$status"
