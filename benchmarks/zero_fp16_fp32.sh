#!/usr/bin/env bash
# The shipped ZeRO configs (torch_autocast "auto") under --fp16 true and under fp32 (--bf16 false), against DDP with
# the same precision: 30 steps of the ViT-B recipe at a constant learning rate (the acceptance suite's settings), on 2
# GPUs, from the repo root with the device wheels (.whl) at hand. Prints each run's start line and losses; writes
# $OUT/zero_fp16_fp32.txt. Record: benchmarks/results/2026-11-27_zero_fp16_fp32_2xH200.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_EVALUATE_OFFLINE=1
python3 -m compileall -q -j 32 $(python3 -c 'import site;print(site.getsitepackages()[0])') /tmp/site src >/dev/null 2>&1
python3 benchmarks/make_assets.py --out bench_assets cifar100 vit-base --train 4000 --test 1000 --workers 16 >/tmp/assets.log 2>&1 || tail -3 /tmp/assets.log
C="--config recipes/vit-base/cifar100/config_full.yaml --model_name_or_path bench_assets/vit-base --dataset_name bench_assets/cifar100 --max_steps 30 --per_device_train_batch_size 32 --warmup_steps 0 --lr_scheduler_type constant --crop_scale_min 1 --hflip_prob 0 --logging_steps 1 --eval_strategy no --save_strategy no --do_eval false --report_to none --plots false --disable_tqdm true --torch_compile_regions false --dataloader_num_workers 2 --log_level info"
export HF_DATASETS_CACHE=/tmp/dsc
run() { name=$1; shift; t=$(date +%s); "$@" $C --output_dir /tmp/z/$name > /tmp/z_$name.log 2>&1; echo "== $name exit $? $(( $(date +%s)-t )) s"; }
DDP="accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 --mixed_precision"
run ddp-fp16 $DDP fp16 run_image_classification.py --bf16 false --fp16 true
run zero2-fp16 deepspeed run_image_classification.py --deepspeed ds_configs/zero2.json --bf16 false --fp16 true
run zero3-fp16 accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 run_image_classification.py --bf16 false --fp16 true
run ddp-fp32 $DDP no run_image_classification.py --bf16 false
run zero2-fp32 deepspeed run_image_classification.py --deepspeed ds_configs/zero2.json --bf16 false
python3 - <<'PY' | tee $OUT/zero_fp16_fp32.txt
import json, os, re
for name in ("ddp-fp16", "zero2-fp16", "zero3-fp16", "ddp-fp32", "zero2-fp32"):
    log = open(f"/tmp/z_{name}.log").read()
    plan = next((l.split("Plan: ", 1)[1] for l in log.splitlines() if "Plan: " in l), "no Plan line")
    try:
        h = json.load(open(f"/tmp/z/{name}/trainer_state.json"))["log_history"]
    except Exception as e:
        print(name, "missing", e, log[-1500:]); continue
    losses = [round(e["loss"], 4) for e in h if "loss" in e]
    print(name, "|", plan[:140], "| step 30 loss", losses[-1], "| losses", losses[::5])
PY
