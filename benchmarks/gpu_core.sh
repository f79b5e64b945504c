python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 || exit;
# The one-GPU core benchmark (H100 or H200), from the repository root, with .whl/ carried along:
#     BENCH_GIT_COMMIT=<commit> bash benchmarks/gpu_core.sh
# Builds local assets (benchmarks/make_assets.py), then runs benchmarks/suites/gpu_core.yaml in priority order:
#   (1) ViT-B/16, CIFAR-100-shaped 50k, bf16, batch 256, 200 steps: the issue's core record
#   (3) the same with gradient checkpointing; (2) bf16 batch 64/128 (fp32 64/128/256 come later, 30 steps)
#   (5) Food-101-shaped subset (8,000 train + 2,000 validation JPEGs): decode with a cold, then a warm cache
#   (4) ViT-H/14 batch 64 bf16, without and with gradient checkpointing
#   then fp32 and, if time is left, torch.compile.
# Everything after the wheel install stays under BENCH_BUDGET seconds (default 420 = 7 min, assets included): runs
# that would not fit are recorded as skipped, a run is cut at the budget. Expected: ~5-6 min; worst case ~7.5 min.
# $OUT gets: gpu_core_results.tar.gz (records, logs, results.md, charts), gpu_core.log, results.md (if the report
# could be drawn there).
START=$(date +%s)
BUDGET=${BENCH_BUDGET:-420}
OUT=${OUT:-/tmp/gpu_core_out}
RESULTS=/tmp/bench/gpu_core
SUITE=benchmarks/suites/gpu_core.yaml
rm -rf "$RESULTS" && mkdir -p "$OUT" "$RESULTS"  # a warm machine may hold the previous call's records
export PYTHONPATH="$PWD/src:$PYTHONPATH" HF_HOME=${HF_HOME:-/tmp/hf} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export BENCH_GIT_COMMIT=${BENCH_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
LOG="$OUT/gpu_core.log"

say() { echo "[gpu_core +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((START + BUDGET - $(date +%s))); }
pack() { tar czf "$OUT/gpu_core_results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" 2>>"$LOG"; }
stage() {  # stage <regex of run names>: run those runs of the suite within the time left, then pack
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt 30 ]; then
    say "no time left for: $1"
    python3 benchmarks/run.py --suite "$SUITE" --results "$RESULTS" --only "$1" --budget 0 2>&1 | tee -a "$LOG"
  else
    say "stage $1 (${remaining}s left)"
    python3 benchmarks/run.py --suite "$SUITE" --results "$RESULTS" --only "$1" --budget "$remaining" 2>&1 | tee -a "$LOG"
  fi
  pack
}

say "commit $BENCH_GIT_COMMIT; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"

say "assets: cifar100 (50,000 + 10,000 PNG 32x32), vit-base"
python3 benchmarks/make_assets.py --out bench_assets cifar100 vit-base --workers 16 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
stage '^vitb-core-'
stage '^vitb-ckpt-|^vitb-single-bf16-'

if [ "$(left)" -gt 90 ]; then
  say "assets: food101 subset (8,000 + 2,000 JPEG 384-640 px), vit-huge"
  python3 benchmarks/make_assets.py --out bench_assets food101 --train 8000 --test 2000 --workers 16 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
  python3 benchmarks/make_assets.py --out bench_assets vit-huge 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
fi
stage '^food-decode-'
stage '^vith-'
stage '^vitb-single-fp32-'
stage '^vitb-compile-'

say "report"
python3 benchmarks/report.py "$RESULTS" --title "Core benchmark: one GPU" 2>&1 | tee -a "$LOG" && cp "$RESULTS/results.md" "$OUT/"
pack
say "done; $(ls "$RESULTS"/*.json | wc -l) records in $OUT/gpu_core_results.tar.gz"
