#!/bin/bash
# one-off device call: import cost check + step overhead suite
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_EVALUATE_OFFLINE=1 BENCH_GIT_COMMIT=$1
nvidia-smi --query-gpu=name --format=csv,noheader





python3 benchmarks/make_assets.py --out bench_assets cifar100 vit-base --train 20000 --test 1000 --workers 16 > /dev/null 2>&1
python3 benchmarks/run.py --suite benchmarks/suites/step_overhead.yaml --results $OUT/rec 2>&1 | tail -40
for f in $OUT/rec/*.json; do python3 -c "import json,sys; r=json.load(open('$f')); m=r.get('metrics',{}); print(r['name'], r.get('status'), m.get('train_images_per_second'), m.get('train_step_time_s'), m.get('train_data_wait_fraction'))"; done
A=$(dirname $(find $OUT/rec -path '*b128-syncs-profiled*' -name '*.pt.trace.json*' | head -1)); B=$(dirname $(find $OUT/rec -path '*b128-no-syncs-profiled*' -name '*.pt.trace.json*' | head -1))
python3 benchmarks/trace_analysis.py $A $B --labels syncs no-syncs --out $OUT/rec/trace_compare.md 2>&1 | tail -5
find $OUT -name '*.pt.trace.json*' -delete; find $OUT -name '*.safetensors' -delete; find $OUT -type d -name 'checkpoint-*' -prune -exec rm -rf {} +
cd $OUT && tar czf rec.tgz rec && rm -rf rec; ls -la $OUT
