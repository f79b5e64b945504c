#!/usr/bin/env bash
# DeepSpeed bf16 mode against torch autocast: DDP, ZeRO-2 and ZeRO-3 in DeepSpeed's bf16 mode (the shipped configs
# until c9b5f67, rebuilt here from today's), ZeRO-2 as shipped now (torch_autocast: fp32 parameters, bf16 compute);
# the ViT-B recipe with its warm-up, 150 steps, no random crop/flip. Run on a 2-GPU machine from the repo root with the device
# wheels (.whl) at hand; writes $OUT/zero_precision.txt. Record: benchmarks/results/2026-11-27_zero_precision_2xH200.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_EVALUATE_OFFLINE=1
python3 -m compileall -q -j 32 $(python3 -c 'import site;print(site.getsitepackages()[0])') /tmp/site src >/dev/null 2>&1
python3 benchmarks/make_assets.py --out bench_assets cifar100 vit-base --train 20000 --test 1000 --workers 16 >/tmp/assets.log 2>&1 || tail -3 /tmp/assets.log
for z in zero2 zero3; do python3 -c "import json; c=json.load(open('ds_configs/$z.json')); c.pop('torch_autocast'); c['bf16']={'enabled': 'auto'}; json.dump(c, open('/tmp/${z}_bf16.json','w'))"; done
C="--config recipes/vit-base/cifar100/config_full.yaml --model_name_or_path bench_assets/vit-base --dataset_name bench_assets/cifar100 --max_steps 150 --crop_scale_min 1 --hflip_prob 0 --logging_steps 10 --eval_strategy no --save_strategy no --do_eval false --report_to none --plots false --disable_tqdm true --torch_compile_regions false --dataloader_num_workers 4"
export HF_DATASETS_CACHE=/tmp/dsc
run() { name=$1; shift; t=$(date +%s); "$@" $C --output_dir /tmp/z/$name > /tmp/z_$name.log 2>&1; echo "== $name exit $? $(( $(date +%s)-t )) s"; }
run ddp accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 run_image_classification.py
run zero2-bf16 deepspeed run_image_classification.py --deepspeed /tmp/zero2_bf16.json
run zero2-autocast deepspeed run_image_classification.py --deepspeed ds_configs/zero2.json
run zero3-bf16 accelerate launch --config_file accelerate_configs/zero3.yaml --deepspeed_config_file /tmp/zero3_bf16.json --num_processes 2 run_image_classification.py
python3 - <<'PY' | tee $OUT/zero_precision.txt
import json, os
for name in ("ddp", "zero2-bf16", "zero2-autocast", "zero3-bf16"):
    d = f"/tmp/z/{name}"
    try:
        h = json.load(open(f"{d}/trainer_state.json"))["log_history"]
        r = json.load(open(f"{d}/all_results.json"))
    except Exception as e:
        print(name, "missing", e); os.system(f"tail -4 /tmp/z_{name}.log"); continue
    print(name, "img/s", round(r.get("train_images_per_second", 0)), "peak GiB", r.get("train_peak_allocated_gib"), "train_loss", round(r.get("train_loss", 0), 4))
    print("  loss", [round(e["loss"], 4) for e in h if "loss" in e])
PY
grep -h "WARNING\|error" /tmp/z_zero2-autocast.log | head -5
