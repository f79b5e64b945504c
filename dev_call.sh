#!/bin/bash
# one-off device call: the wall-clock benchmark at this commit
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_EVALUATE_OFFLINE=1 BENCH_GIT_COMMIT=$1
nvidia-smi --query-gpu=name --format=csv,noheader
s=$(date +%s); python3 benchmarks/make_assets.py --out bench_assets cifar100 vit-base --workers 16 > /dev/null 2>&1; echo "assets $(( $(date +%s) - s )) s"
python3 benchmarks/wall_clock.py --assets bench_assets --out $OUT/wc --work /tmp/wc --budget 400 --timeout 150 \
  --only epoch-peer-w16-cold,epoch-ours-cold,epoch-ours-warm,steps200-peer-w16-cold,steps200-ours-cold,steps200-ours-warm 2>&1 | grep -v "it/s\]" | tail -30
for r in /tmp/wc/runs/*-ours-*; do echo "== $r"; tail -c 1500 $r/../../logs/$(basename $r).log 2>/dev/null | grep -iE "warn|error" | head -5; done
ls $OUT/wc
