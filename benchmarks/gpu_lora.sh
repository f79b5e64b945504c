[ -z "$GPU_LORA_CPU" ] && [ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 || exit; }
# LoRA on GPUs: speed, memory and the strategies, from the repository root (with .whl/ carried along: it holds the
# peft wheel the script needs):
#     bash benchmarks/gpu_lora.sh                  # one H100/H200, ~4-5 min; results in $OUT
#     NPROC=2 bash benchmarks/gpu_lora.sh          # the strategy checks on 2 GPUs (DDP joins them)
#     GPU_LORA_CPU=1 bash benchmarks/gpu_lora.sh   # the same logic on a CPU with tiny assets (checks this script)
#     GPU_LORA_PARTS="strategies reload" NPROC=2 bash benchmarks/gpu_lora.sh   # only some parts (speed, vith,
#                                                                             # strategies, reload, full, transfer)
#     GPU_LORA_PARTS=transfer bash benchmarks/gpu_lora.sh   # the transfer check at full size (~6 min, one GPU):
#         `python benchmarks/transfer.py` (docs/lora.md); needs Fashion-MNIST's idx files in FASHION_MNIST
#         (default /usr/share/datasets/fashion-mnist from `apt-get install dataset-fashion-mnist`, else
#         data/fashion-mnist-idx carried along)
# Runs, in priority order (what does not fit in GPU_LORA_BUDGET seconds, default 300, is recorded as skipped):
#   vitb-full / vitb-lora: ViT-B/16, CIFAR-100-shaped, bf16, batch 256, 60 steps: img/s and peak memory, full vs LoRA
#   vith-lora / vith-lora-ckpt: ViT-H/14, batch 64, 30 steps, LoRA without and with gradient checkpointing
#   zero3-merged / zero2 / fsdp2-merged-ckpt (and ddp-reentrant with NPROC >= 2): LoRA through
#     accelerate_configs/*.yaml, 20 steps, evaluated; adapters and merged models saved under each strategy
#   reload: every evaluated run is evaluated again from its saved folder (the adapter put back on its base, or the
#     merged plain model): test accuracy must match; the merged ones also load in transformers.pipeline
#   vith-full: ViT-H/14 full fine-tuning at batch 64, for the memory comparison (last: gpu_core.sh measures it too)
# Assets: benchmarks/make_assets.py (random-init checkpoints and class-colour images: speed, memory and save/reload
# correctness, not accuracy; the accuracy of LoRA against full fine-tuning is `python benchmarks/transfer.py`).
# $OUT gets gpu_lora.json (one record per run + checks), gpu_lora.md (tables) and gpu_lora.log.
START=$(date +%s)
BUDGET=${GPU_LORA_BUDGET:-285}
PARTS=${GPU_LORA_PARTS:-speed vith strategies reload full}
has() { [[ " $PARTS " == *" $1 "* ]]; }
OUT=${OUT:-/tmp/gpu_lora_out}
RESULTS=${GPU_LORA_RESULTS:-/tmp/bench/gpu_lora}
NPROC=${NPROC:-1}
rm -rf "$RESULTS" && mkdir -p "$OUT" "$RESULTS"
export PYTHONPATH="$PWD/src:$PYTHONPATH" HF_HOME=${HF_HOME:-/tmp/hf} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
LOG="$OUT/gpu_lora.log"
: >"$LOG"
say() { echo "[gpu_lora +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((START + BUDGET - $(date +%s))); }

if [ -n "$GPU_LORA_CPU" ]; then
  ASSETS=${GPU_LORA_ASSETS:-/tmp/gpu_lora_assets}
  MODEL_B=$ASSETS/vit-tiny MODEL_H=$ASSETS/vit-tiny DATA=$ASSETS/cifar100
  COMMON=(--use_cpu true --dataloader_num_workers 0)
  PRECISION=(); MIXED=no; BATCH_B=32; BATCH_H=16; STEPS_SPEED=10; STEPS_STRAT=8; EVAL_N=256
  STRATEGIES="zero3-merged zero2"  # FSDP needs GPUs
  export OMP_NUM_THREADS=1
  say "CPU dry run: tiny assets in $ASSETS"
  python3 benchmarks/make_assets.py --out "$ASSETS" cifar100 --train 2000 --test 500 --workers 2 >>"$LOG" 2>&1
  python3 - "$MODEL_B" <<'PY' >>"$LOG" 2>&1
import sys, torch
from pathlib import Path
from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor
if not Path(sys.argv[1], "config.json").is_file():
    torch.manual_seed(0)
    ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, num_labels=2)).save_pretrained(sys.argv[1])
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(sys.argv[1])
PY
else
  ASSETS=bench_assets
  MODEL_B=$ASSETS/vit-base MODEL_H=$ASSETS/vit-huge DATA=$ASSETS/cifar100
  COMMON=(--dataloader_num_workers 8)
  PRECISION=(--bf16 true); MIXED=bf16; BATCH_B=256; BATCH_H=64; STEPS_SPEED=40; STEPS_STRAT=20; EVAL_N=2000
  STRATEGIES="zero3-merged zero2 fsdp2-merged-ckpt"  # FSDP2 last: it failed for full fine-tuning too (README)
  say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1); NPROC=$NPROC"
  say "assets: cifar100 (50,000 + 10,000 PNG 32x32; kept if there), vit-base, vit-huge (random init)"
  python3 benchmarks/make_assets.py --out "$ASSETS" cifar100 vit-base vit-huge --workers 16 2>&1 \
    | grep -v "it/s\]" | tee -a "$LOG"
fi
[ "$NPROC" -ge 2 ] && STRATEGIES="ddp-reentrant $STRATEGIES"
python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tee -a "$LOG"

# run NAME MIN_SECONDS LAUNCH -- SCRIPT_ARGS...: one training run into $RESULTS/NAME, skipped when time is short.
run() {
  local name=$1 need=$2; shift 2
  local launch=()
  while [ "$1" != "--" ]; do launch+=("$1"); shift; done
  shift
  if [ "$(left)" -lt "$need" ]; then
    say "skip $name: $(left)s left, needs ~${need}s"
    echo "{\"name\": \"$name\", \"status\": \"skipped\"}" >"$RESULTS/$name.record.json"
    return
  fi
  say "run $name"
  local t0=$(date +%s)
  local limit=$(( $(left) > 30 ? $(left) : 30 ))
  timeout "$limit" "${launch[@]}" run_image_classification.py --output_dir "$RESULTS/$name" \
    --overwrite_output_dir true --do_train true --save_strategy no --eval_strategy no --report_to none \
    --plots false --disable_tqdm true --logging_steps 10 "${COMMON[@]}" "${PRECISION[@]}" "$@" \
    >"$RESULTS/$name.log" 2>&1
  local rc=$?
  local wall=$(( $(date +%s) - t0 ))
  grep -E "^(LoRA|Full fine-tuning|Head only):" "$RESULTS/$name.log" | tee -a "$LOG"
  [ $rc -ne 0 ] && { say "FAILED $name (exit $rc):"; tail -5 "$RESULTS/$name.log" | tee -a "$LOG"; }
  python3 - "$RESULTS" "$name" "$rc" "$wall" "${launch[*]} run_image_classification.py $*" <<'PY'
import json, sys
from pathlib import Path
results, name, rc, wall, command = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
metrics_file = results / name / "all_results.json"
metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
saved = {p.name: p.stat().st_size for p in (results / name).glob("*.safetensors")} if (results / name).is_dir() else {}
record = {"name": name, "status": "ok" if rc == 0 else "failed", "exit_code": rc, "wall_seconds": wall,
          "command": command, "metrics": metrics, "saved_bytes": saved}
(results / f"{name}.record.json").write_text(json.dumps(record, indent=2))
PY
}

single=(python3)
launch() {  # launch CONFIG: accelerate with one of accelerate_configs/*.yaml on NPROC processes
  echo python3 -m accelerate.commands.launch --config_file "accelerate_configs/$1" --num_processes "$NPROC" \
    --num_machines 1 --mixed_precision "$MIXED" --main_process_port $((29500 + RANDOM % 2000))
}
EVAL=(--do_eval true --max_eval_samples "$EVAL_N" --per_device_eval_batch_size 256)

# 1. ViT-B/16: full fine-tuning vs LoRA (default r=16 on query/value + head), same batch and steps.
if has speed; then
run vitb-full 60 "${single[@]}" -- --model_name_or_path "$MODEL_B" --dataset_name "$DATA" \
  --per_device_train_batch_size "$BATCH_B" --max_steps "$STEPS_SPEED" --learning_rate 1e-4 --do_eval false
run vitb-lora 60 "${single[@]}" -- --model_name_or_path "$MODEL_B" --dataset_name "$DATA" \
  --per_device_train_batch_size "$BATCH_B" --max_steps "$STEPS_SPEED" --learning_rate 2e-3 --use_peft true "${EVAL[@]}"
fi
# 2. ViT-H/14 LoRA without and with gradient checkpointing (non-reentrant, the default kwargs).
if has vith; then
run vith-lora 60 "${single[@]}" -- --model_name_or_path "$MODEL_H" --dataset_name "$DATA" \
  --per_device_train_batch_size "$BATCH_H" --max_steps 25 --learning_rate 1e-3 --use_peft true --do_eval false
run vith-lora-ckpt 60 "${single[@]}" -- --model_name_or_path "$MODEL_H" --dataset_name "$DATA" \
  --per_device_train_batch_size "$BATCH_H" --max_steps 25 --learning_rate 1e-3 --use_peft true --do_eval false \
  --gradient_checkpointing true
fi
# 3. Strategies: LoRA trained, saved (adapter or merged) and evaluated under each.
STRAT_ARGS=(--model_name_or_path "$MODEL_B" --dataset_name "$DATA" --per_device_train_batch_size 64
  --max_steps "$STEPS_STRAT" --learning_rate 2e-3 --use_peft true "${EVAL[@]}")
has strategies || STRATEGIES=""
for strategy in $STRATEGIES; do
  case $strategy in
    ddp-reentrant) run lora-$strategy 50 $(launch ddp.yaml) -- "${STRAT_ARGS[@]}" --gradient_checkpointing true \
      --gradient_checkpointing_kwargs '{"use_reentrant": true}' ;;
    zero2) run lora-$strategy 60 $(launch zero2.yaml) -- "${STRAT_ARGS[@]}" ;;
    zero3-merged) run lora-$strategy 60 $(launch zero3.yaml) -- "${STRAT_ARGS[@]}" --merge_adapter true ;;
    fsdp2-merged-ckpt) run lora-$strategy 60 $(launch fsdp.yaml) -- "${STRAT_ARGS[@]}" --merge_adapter true \
      --gradient_checkpointing true ;;
  esac
done

# 4. Reload every evaluated run from its folder, in one process: same test accuracy; merged ones in a pipeline.
if has reload && [ "$(left)" -gt 20 ]; then
  say "reload checks"
  python3 - "$RESULTS" "$DATA" "$EVAL_N" "${COMMON[@]}" "${PRECISION[@]}" <<'PY' 2>>"$RESULTS/reload.log" | tee -a "$LOG"
import json, sys
from pathlib import Path
sys.path.insert(0, ".")
import run_image_classification as script
from vit_recipes.lora import is_adapter_dir, load_model

results, data, n, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
checks = {}
for record_file in sorted(results.glob("*.record.json")):
    record = json.loads(record_file.read_text())
    trained = record.get("metrics", {}).get("test_accuracy")
    folder = results / record["name"]
    if record.get("status") != "ok" or trained is None:
        continue
    kind = "adapter" if is_adapter_dir(folder) else "merged" if (folder / "model.safetensors").is_file() else "?"
    check = {"kind": kind, "trained_test_accuracy": trained}
    try:
        again = script.main(["--model_name_or_path", str(folder), "--dataset_name", data,
                             "--output_dir", str(folder) + "-reload", "--overwrite_output_dir", "true",
                             "--do_train", "false", "--do_eval", "true", "--eval_strategy", "no", "--max_eval_samples", n,
                             "--per_device_eval_batch_size", "256", "--report_to", "none", "--plots", "false",
                             "--disable_tqdm", "true", *extra])
        check["reloaded_test_accuracy"] = again["test_accuracy"]
        # One process, bf16 autocast both times: equal up to a rare tie. The strategy runs evaluated on several ranks
        # (DDP evaluates other batches; the strategy records saw 0.4 points for full fine-tuning) or with bf16 weights
        # (ZeRO; FSDP2 casts to bf16), the reload fp32 weights under autocast; merged W + BA rounds anew.
        strategy_run = record["name"].startswith("lora-")
        tolerance = (0.02 if strategy_run else 0.002) + (0.005 if kind == "merged" else 0.0)
        check["tolerance"] = tolerance
        check["same_accuracy"] = abs(again["test_accuracy"] - trained) <= tolerance
        if kind == "merged":
            from PIL import Image
            from transformers import pipeline

            classifier = pipeline("image-classification", model=str(folder), device=0 if "--use_cpu" not in extra else "cpu")
            check["pipeline_top1"] = classifier(Image.new("RGB", (32, 32), (200, 30, 30)), top_k=1)[0]
        else:
            check["load_model"] = type(load_model(folder)).__name__
    except Exception as err:  # record and go on: one broken reload must not hide the others
        check["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        check["same_accuracy"] = False
    checks[record["name"]] = check
    print(f"reload {record['name']}: {json.dumps(check)}", flush=True)
(results / "reload_checks.json").write_text(json.dumps(checks, indent=2))
PY
elif has reload; then
  say "skip reload checks: $(left)s left"
fi

# 5. ViT-H/14 full fine-tuning, for the memory comparison, if time is left.
has full && run vith-full 60 "${single[@]}" -- --model_name_or_path "$MODEL_H" --dataset_name "$DATA" \
  --per_device_train_batch_size "$BATCH_H" --max_steps 25 --learning_rate 5e-5 --do_eval false

# 6. The transfer check (not in the default parts: it takes a command of its own, ~6 minutes).
if has transfer; then
  FASHION=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
  [ -f "$FASHION/train-images-idx3-ubyte.gz" ] || FASHION=data/fashion-mnist-idx
  say "transfer check (Fashion-MNIST from $FASHION)"
  TRANSFER_ARGS=()
  [ -n "$GPU_LORA_CPU" ] && TRANSFER_ARGS=(--size test)
  python3 benchmarks/transfer.py --fashion_mnist "$FASHION" --out "$RESULTS/transfer" --work /tmp/lora_transfer_work --budget 480 \
    "${TRANSFER_ARGS[@]}" 2>&1 | grep -v "it/s\]" | tee -a "$LOG"
  cp "$RESULTS/transfer/lora_transfer.json" "$RESULTS/transfer/lora_transfer.md" "$OUT/" 2>>"$LOG"
fi

say "summary"
python3 - "$RESULTS" "$OUT" "$NPROC" <<'PY' 2>&1 | tee -a "$LOG"
import json, platform, sys
from pathlib import Path

results, out, nproc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
records = [json.loads(p.read_text()) for p in sorted(results.glob("*.record.json"), key=lambda p: p.stat().st_mtime)]
checks_file = results / "reload_checks.json"
checks = json.loads(checks_file.read_text()) if checks_file.is_file() else {}
try:
    import peft, torch, transformers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
except Exception as err:  # pragma: no cover
    versions, device = {"error": str(err)}, "?"
summary = {"device": device, "nproc": nproc, "host": platform.node(), "versions": versions, "runs": records,
           "reload_checks": checks}
(out / "gpu_lora.json").write_text(json.dumps(summary, indent=2))

def cell(value, fmt="{:,.1f}"):
    return fmt.format(value) if isinstance(value, (int, float)) else "-"

lines = [f"LoRA benchmark on {device} (NPROC={nproc}); {', '.join(f'{k} {v}' for k, v in versions.items())}", "",
         "| Run | Status | Trainable | Train img/s (steady) | img/s (whole run) | Peak allocated GiB | Peak reserved GiB | Saved MB | Wall s |",
         "|---|---|---|---|---|---|---|---|---|"]
for r in records:
    m = r.get("metrics", {})
    share = m.get("train_trainable_percent")
    saved = sum(r.get("saved_bytes", {}).values()) / 1e6 if r.get("saved_bytes") else None
    lines.append(f"| {r['name']} | {r['status']} | {cell(share, '{:.2f}%')} | {cell(m.get('train_images_per_second'))} "
                 f"| {cell(m.get('train_samples_per_second'))} | {cell(m.get('train_peak_allocated_gib'), '{:.2f}')} "
                 f"| {cell(m.get('train_peak_reserved_gib'), '{:.2f}')} | {cell(saved, '{:.1f}')} | {r.get('wall_seconds', '-')} |")
if checks:
    lines += ["", "| Reloaded | Kind | Test acc. after training | Test acc. reloaded | Same |", "|---|---|---|---|---|"]
    for name, c in checks.items():
        lines.append(f"| {name} | {c['kind']} | {cell(c.get('trained_test_accuracy'), '{:.4f}')} "
                     f"| {cell(c.get('reloaded_test_accuracy'), '{:.4f}')} | {'yes' if c.get('same_accuracy') else 'NO ' + c.get('error', '')} |")
(out / "gpu_lora.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
failed = [r["name"] for r in records if r["status"] == "failed"] + [n for n, c in checks.items() if not c.get("same_accuracy")]
print("FAILED: " + ", ".join(failed) if failed else "all runs and reload checks passed")
PY
say "done: $OUT/gpu_lora.json, $OUT/gpu_lora.md"
