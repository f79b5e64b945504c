#!/usr/bin/env bash
# Probe of benchmarks/results/2026-11-28_compiled_gap_1xH200: three device calls, each on its machine, from the repository
# root with the device wheels in .whl/: 21 (nvidia-h200-x4, GPU 0: decode workers), 22 (nvidia-h200: CPU load beside
# the uint8 cache), 23 (nvidia-h200: the CIFAR job stored at 32 or 256 px, with and without TrivialAugment).
CALL=${1:?21, 22 or 23}
cd "$(dirname "$0")/.."
if [ "$CALL" = 21 ]; then
ls /tmp/site/datasets >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
T0=$(date +%s)
python benchmarks/make_assets.py --out /tmp/assets cifar100 vit-base --workers 8 > /tmp/assets.log 2>&1 &
a=$!
python tools/jpeg_folder.py /tmp/wc/jpegs_60000 --images 60000 --classes 100 | tail -1 &
gen=$!
PYTHONPATH=/tmp/site:$PWD/src python -c "from transformers import Trainer; import datasets, evaluate, torchdata, deepspeed, run_image_classification" 2>&1 | tail -1
wait $gen $a; echo "setup $(( $(date +%s) - T0 )) s"
W="--work /tmp/wc --assets /tmp/assets --photos 60000 --timeout 150 --budget 540"
export CUDA_VISIBLE_DEVICES=0
one() {  # name, --only, extra
  python -m benchmarks.wall_clock $W --out /tmp/rec/$1 --only $2 --extra "$3" > /dev/null 2>&1
  python -c "
import json; r=json.load(open('/tmp/rec/$1/wall_clock.json'))['runs'][0]; m=r['metrics']
print(json.dumps({'run': '$1', 'wall_s': r['wall_s'], **{k: v for k, v in m.items() if not k.startswith('time_')}}))" | tee -a $OUT/sweep.jsonl
}
C="--torch_compile_regions true"
for rep in 1; do
  one cifar_compiled_$rep epoch-ours-compiled-cold ""
  one food_wdefault_$rep photos200-ours-cold "$C"; for w in 32 16; do one food_w${w}_$rep photos200-ours-cold "$C --dataloader_num_workers $w"; done
done
echo "all $(( $(date +%s) - T0 )) s"
fi
if [ "$CALL" = 22 ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nproc; lscpu | grep -E "Model name|MHz"; T0=$(date +%s)
python benchmarks/make_assets.py --out /tmp/assets cifar100 vit-base --workers 6 > /tmp/assets.log 2>&1 &
a=$!
python tools/jpeg_folder.py /tmp/wc/jpegs_60000 --images 60000 --classes 100 | tail -1 &
gen=$!
PYTHONPATH=/tmp/site:$PWD/src python -c "from transformers import Trainer; import datasets, evaluate, torchdata, deepspeed, run_image_classification" 2>&1 | tail -1
wait $gen $a; echo "setup $(( $(date +%s) - T0 )) s"
W="--work /tmp/wc --assets /tmp/assets --photos 60000 --timeout 150 --budget 560"
one() {  # name, --only, extra
  python -m benchmarks.wall_clock $W --out /tmp/rec/$1 --only $2 --extra "$3" > /tmp/rec_$1.log 2>&1 || tail -5 /tmp/rec_$1.log
  python -c "
import json; r=json.load(open('/tmp/rec/$1/wall_clock.json'))['runs'][0]; m=r['metrics']
print(json.dumps({'run': '$1', 'wall_s': r['wall_s'], **{k: m.get(k) for k in ('train_images_per_second', 'train_step_time_s', 'train_data_wait_fraction', 'data_decode_seconds')}}))" | tee -a $OUT/why.jsonl
}
load() {  # N PIL decode loops at nice +10, as the decode workers would be
  for i in $(seq $1); do nice -n 10 python -c "
from PIL import Image; import glob
fs = sorted(glob.glob('/tmp/wc/jpegs_60000/validation/*/*.jpg'))[$i*300:$i*300+300]
while True:
    for f in fs:
        im = Image.open(f); im.draft('RGB', (256, 256)); im.convert('RGB').resize((256, 256))" & done
}
C="--torch_compile_regions true"
one cifar epoch-ours-compiled-cold ""
one food_batch photos200-ours-cold "$C"
one food_once photos200-ours-once-cold "$C"
load 8; sleep 2; one food_once_load8 photos200-ours-once-cold "$C"; pkill -f "im.draft" ; sleep 1
one food_batch_w8 photos200-ours-cold "$C --dataloader_num_workers 8"
echo "all $(( $(date +%s) - T0 )) s"
fi
if [ "$CALL" = 23 ]; then
ls /tmp/site/datasets >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
T0=$(date +%s)
ls /tmp/assets/cifar100 >/dev/null 2>&1 || python benchmarks/make_assets.py --out /tmp/assets cifar100 vit-base --workers 12 > /tmp/assets.log 2>&1
PYTHONPATH=/tmp/site:$PWD/src python -c "from transformers import Trainer; import datasets, evaluate, torchdata, deepspeed, run_image_classification" 2>&1 | tail -1
echo "setup $(( $(date +%s) - T0 )) s"
W="--work /tmp/wc --assets /tmp/assets --timeout 150 --budget 480"
one() {  # name, --only, extra
  python -m benchmarks.wall_clock $W --out /tmp/rec/$1 --only $2 --extra "$3" > /tmp/rec_$1.log 2>&1 || tail -5 /tmp/rec_$1.log
  python -c "
import json; r=json.load(open('/tmp/rec/$1/wall_clock.json'))['runs'][0]; m=r['metrics']
print(json.dumps({'run': '$1', 'wall_s': r['wall_s'], **{k: m.get(k) for k in ('train_images_per_second', 'train_step_time_s', 'train_data_wait_fraction', 'data_decode_seconds')}}))" | tee -a $OUT/gap.jsonl
}
B="--storage_size 256 --decode_images per_batch"; T="--auto_augment trivialaugment"
one cifar32 epoch-ours-compiled-cold ""
one cifar256 epoch-ours-compiled-cold "$B"
one cifar32_ta epoch-ours-compiled-cold "$T"
one cifar256_ta epoch-ours-compiled-cold "$B $T"
echo "all $(( $(date +%s) - T0 )) s"
fi
