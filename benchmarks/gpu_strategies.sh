python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH" || exit;
# GPU proof of the distributed strategies, from the repository root with .whl/ carried along; run it on 1 GPU and
# on 2 GPUs (each call uses every visible GPU):
#     bash benchmarks/gpu_strategies.sh
# Builds small local assets (CIFAR-100-shaped 8,000 + 1,000 PNG, randomly initialised ViT-B/16 with a 2-label head),
# then benchmarks/gpu_strategies.py launches, in priority order, through the shipped configs and both launchers:
#   2 GPUs: DDP (reference), FSDP2 (+ activation checkpointing), FSDP2 resume, FSDP2 + CPU offload, ZeRO-3
#           (+ checkpointing), ZeRO-2 fp16, ZeRO-3 replacing the checkpoint's head, too-many-processes refusal,
#           ZeRO++, ZeRO-3 offload, ZeRO-1, ZeRO-2 offload (DeepSpeedCPUAdam), ZeRO-3 resume;
#   1 GPU:  single bf16 (reference), fp16, 2-processes-on-1-GPU refusal, resume, ZeRO-3 offload (new head).
# Each run: 20 steps, global batch 64, 224 px, rank reports on; checked from what the ranks wrote (world size,
# wrapper, ZeRO stage, shard sizes, offload, checkpointing), losses vs the reference, the saved model reloaded and
# re-scored without DeepSpeed/FSDP, resumed weights vs uninterrupted. Runs stay within STRAT_BUDGET seconds
# (default 120 on 1 GPU, 300 on 2; what does not fit is recorded as skipped): about 3 + 6 minutes with assets.
# $OUT gets: summary.md (one line per check, PASS/FAIL), summary.json, strategies_runs.tar.gz (rank reports,
# all_results.json, trainer_state.json and logs of every run), gpu_strategies.log.
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_strategies_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PYTHONPATH" HF_HOME=${HF_HOME:-/tmp/hf} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/gpu_strategies.log"
say() { echo "[gpu_strategies +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
say "versions: $(python3 -c 'import torch, transformers, accelerate, deepspeed; print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}")' 2>&1 | tail -1)"
say "assets: cifar100 (8,000 + 1,000 PNG 32x32) and vit-base in /tmp/bench_assets_strategies/"
python3 benchmarks/make_assets.py --out /tmp/bench_assets_strategies cifar100 vit-base --train 8000 --test 1000 --workers 16 2>&1 | grep -v "it/s\]" | tee -a "$LOG"

python3 benchmarks/gpu_strategies.py --out "$OUT" --assets /tmp/bench_assets_strategies ${STRAT_BUDGET:+--budget "$STRAT_BUDGET"} ${STRAT_ONLY:+--only "$STRAT_ONLY"} 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ -f "$OUT/summary.md" ] && tail -n 1 "$OUT/summary.md" | tee -a "$LOG"
say "done (exit $rc): $OUT/summary.md"
exit "$rc"
