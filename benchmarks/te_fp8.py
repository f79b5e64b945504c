"""Transformer Engine FP8 (`--fp8 true --fp8_backend transformer_engine`) against the fast default (bf16 with
regional compilation), on one GPU, in the same call.

    python benchmarks/te_fp8.py --out OUT --parts layers vit-b       # then, with the same OUT: --parts vit-h
    python benchmarks/te_fp8.py --out OUT --parts vit-b --preset cpu --modes eager   # the CPU smoke run (tests)

Parts, each added to OUT/te_fp8.json (a part run again replaces its entries):
- layers: one ViT layer's forward + backward (ms, peak GiB): transformers' layer eager and compiled, ours through TE
  in FP8, eager and (if it compiles) compiled; and FP8 against bf16 on a whole ViT-B (logits, loss, gradients).
- vit-b, vit-h: run_image_classification.py trains ViT-B/16 (batch 512) or ViT-H/14 (batch 64 and 128) from scratch
  on Fashion-MNIST photos upsampled to 224 px, once per mode (`default`: no flag; `te-fp8`: the two flags);
  steady img/s, peak memory and the logged loss curves.
Then OUT/te_fp8.md and OUT/loss_curves.png are drawn from the whole record.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import compile_parity
import transfer
from patch_dropout import git_commit

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "default": [],
    "te-fp8": ["--fp8", "true", "--fp8_backend", "transformer_engine"],
    "eager": ["--torch_compile_regions", "false"],
}
VIT_B = (
    "image_size=224,patch_size=16,hidden_size=768,num_hidden_layers=12,num_attention_heads=12,intermediate_size=3072"
)
VIT_H = (
    "image_size=224,patch_size=14,hidden_size=1280,num_hidden_layers=32,num_attention_heads=16,intermediate_size=5120"
)
# Fashion-MNIST subsets: every run reads the same images; evaluation is small (the speed is the training's).
GPU_PRESET = compile_parity.Preset(
    model=VIT_B, steps=300, batch=512, learning_rate=5e-4, train=None, validation=2000, test=2000,
    logging_steps=10, eval_batch=250, extra=["--bf16", "true"],
)  # fmt: skip
PARTS = {  # part -> (model, [(batch, steps)]) on a GPU
    "vit-b": (VIT_B, [(512, 300)]),
    "vit-h": (VIT_H, [(64, 100), (128, 60)]),
}
CPU_PRESET = compile_parity.Preset(
    model=transfer.TINY_VIT, steps=20, batch=32, learning_rate=3e-3, train=500, validation=100, test=100,
    logging_steps=5, eval_batch=50, extra=[*transfer.CPU, "--disable_tqdm", "true"],
)  # fmt: skip


def vit_config(overrides: str, **extra):
    """A ViTConfig from the script's --config_overrides string, with SDPA attention (what the script's models use)."""
    from transformers import ViTConfig

    sizes = {key: int(value) for key, value in (item.split("=") for item in overrides.split(","))}
    return ViTConfig(**sizes, **extra, attn_implementation="sdpa")


def time_ms(step, iterations: int = 20) -> float:
    import torch

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    return round(1000 * (time.perf_counter() - start) / iterations, 2)


def layer_timings() -> list[dict]:
    """One layer forward + backward under bf16 autocast, per variant: ms and peak GiB (or the error)."""
    import copy

    import torch
    from transformers.models.vit.modeling_vit import ViTLayer

    from vit_recipes.fp8 import TransformerEngineViTLayer

    rows = []
    for name, overrides, batch, tokens in (("ViT-B", VIT_B, 512, 197), ("ViT-H", VIT_H, 64, 257),
                                           ("ViT-H", VIT_H, 128, 257)):  # fmt: skip
        config = vit_config(overrides)
        hf = ViTLayer(config).cuda().train()
        te = copy.deepcopy(hf)
        te.__class__ = TransformerEngineViTLayer
        x = torch.randn(batch, tokens, config.hidden_size, device="cuda", requires_grad=True)
        variants = {"transformers eager": hf, "transformers compiled": torch.compile(hf), "ours, TE FP8": te,
                    "ours, TE FP8 compiled": torch.compile(te)}  # fmt: skip
        for variant, layer in variants.items():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

            def step(layer=layer, x=x):
                with torch.autocast("cuda", torch.bfloat16):
                    out = layer(x)
                out.float().square().mean().backward()

            row = {"model": name, "batch": batch, "tokens": tokens, "variant": variant}
            try:
                row["ms"] = time_ms(step)
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            except Exception as err:  # noqa: BLE001 - recorded: a variant that cannot run is a result
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def fp8_numerics() -> dict:
    """A whole ViT-B/16 (random init), one batch of 64 in training mode: FP8 through TE against bf16."""
    import copy

    import torch
    from transformers import ViTForImageClassification

    from vit_recipes.fp8 import convert_to_transformer_engine

    torch.manual_seed(0)
    config = vit_config(VIT_B, num_labels=10)
    reference = ViTForImageClassification(config).cuda().train()
    model = copy.deepcopy(reference)
    convert_to_transformer_engine(model)
    pixels, labels = torch.randn(64, 3, 224, 224, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    outputs = {}
    for name, m in (("bf16", reference), ("fp8", model)):
        with torch.autocast("cuda", torch.bfloat16):
            out = m(pixel_values=pixels, labels=labels)
        out.loss.backward()
        grads = torch.cat([p.grad.flatten().float() for p in m.parameters()])
        outputs[name] = (out.logits.float(), out.loss.item(), grads)
    (la, loss_a, ga), (lb, loss_b, gb) = outputs["bf16"], outputs["fp8"]
    return {
        "state_dict_keys_equal": model.state_dict().keys() == reference.state_dict().keys(),
        "logits_relative_error": round(((lb - la).norm() / la.norm()).item(), 5),
        "loss_bf16": round(loss_a, 5),
        "loss_fp8": round(loss_b, 5),
        "gradient_cosine_similarity": round(torch.nn.functional.cosine_similarity(ga, gb, dim=0).item(), 5),
    }


def runs(
    part: str, preset: compile_parity.Preset, modes: list[str], work: Path, data: Path, cuda: bool, out: list, save
) -> None:
    """Train each batch size of `part` once per mode, appending each run to `out` and saving after each."""
    model, shapes = PARTS[part] if cuda else (preset.model, [(preset.batch, preset.steps)])
    for batch, steps in shapes:
        for mode in modes:
            run_preset = replace(preset, model=model, batch=batch, steps=steps)
            label = f"{part}-b{batch}-{mode}"
            (work / label).mkdir(parents=True, exist_ok=True)
            try:
                run = compile_parity.train(work / label, data, run_preset, mode, MODES[mode], seed=0)
                results = json.loads((work / label / f"{mode}-seed0" / "all_results.json").read_text())
                run["peak_allocated_gib"] = results.get("train_peak_allocated_gib")
            except RuntimeError as err:  # recorded: one failing mode must not lose the others
                run = {"mode": mode, "error": str(err)[-1500:]}
            run.update(part=part, batch=batch, steps=steps)
            out.append(run)
            save()
            print(f"{label}: {run.get('train_images_per_second', run.get('error'))}", flush=True)


def markdown(record: dict) -> str:
    lines = ["# Transformer Engine FP8 against the fast default (bf16, regional compilation)", ""]
    for entry in record["calls"]:
        lines.append(f"- {entry['parts']}: {entry['device']}, commit {entry['commit']}: `{entry['command']}`")
    if record.get("numerics"):
        n = record["numerics"]
        lines += ["", "## FP8 against bf16, one ViT-B/16 training batch of 64 (random init)", "",
                  f"Logits' relative error {n['logits_relative_error']}; loss {n['loss_bf16']} (bf16) vs "
                  f"{n['loss_fp8']} (FP8); gradients' cosine similarity {n['gradient_cosine_similarity']}; "
                  f"state-dict keys unchanged: {n['state_dict_keys_equal']}."]  # fmt: skip
    if record.get("layers"):
        lines += ["", "## One layer, forward + backward, bf16 autocast", "",
                  "| layer | batch x tokens | variant | ms | peak GiB |", "|---|---|---|---:|---:|"]  # fmt: skip
        for r in record["layers"]:
            ms = r.get("ms", f"fails: {r.get('error', '')[:120]}")
            lines.append(
                f"| {r['model']} | {r['batch']} x {r['tokens']} | {r['variant']} | {ms} | {r.get('peak_gib', '')} |"
            )
    if record.get("runs"):
        lines += ["", "## The script end to end (Fashion-MNIST upsampled to 224 px, from scratch, one seed)", "",
                  "| model | batch | steps | mode | compiled | img/s | x default | peak GiB | final loss | test accuracy |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in record["runs"]:
            if "error" in r:
                lines.append(f"| {r['part']} | {r['batch']} | {r['steps']} | {r['mode']} | fails: "
                             f"{r['error'].splitlines()[-1][:150]} | | | | | |")  # fmt: skip
                continue
            base = next((b for b in record["runs"] if b["part"] == r["part"] and b["batch"] == r["batch"]
                         and b["mode"] == "default" and "error" not in b), None)  # fmt: skip
            ratio = f"{r['train_images_per_second'] / base['train_images_per_second']:.2f}x" if base else ""
            lines.append(
                f"| {r['part']} | {r['batch']} | {r['steps']} | {r['mode']} | {'yes' if r['compiled'] else 'no'} "
                f"| {r['train_images_per_second']:,.0f} | {ratio} | {r.get('peak_allocated_gib') or ''} "
                f"| {r['loss'][-1][1]:.4f} | {r['test_accuracy']:.2%} |"
            )
        lines += ["", "![loss curves](loss_curves.png)"]
    return "\n".join(lines) + "\n"


def chart(record: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = sorted({(r["part"], r["batch"]) for r in record["runs"] if "error" not in r})
    if not groups:
        return
    fig = Figure(figsize=(5 * len(groups), 4), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, (part, batch) in zip(axes, groups):
        for r in record["runs"]:
            if (r["part"], r["batch"]) == (part, batch) and "error" not in r:
                steps, values = zip(*r["loss"], strict=True)
                ax.plot(steps, values, label=f"{r['mode']} ({r['train_images_per_second']:,.0f} img/s)")
        ax.set(xlabel="training step", ylabel="training loss (logged)", title=f"{part}, batch {batch}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/te_fp8")
    parser.add_argument("--parts", nargs="+", choices=["layers", *PARTS], default=["layers", "vit-b", "vit-h"])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["default", "te-fp8"])
    parser.add_argument("--preset", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--fashion_mnist", default=transfer.FASHION_MNIST, help="folder of the idx .gz files")
    parser.add_argument("--replot", action="store_true", help="only redraw OUT's markdown and chart")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_file = out / "te_fp8.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {"calls": [], "runs": []}

    def save():
        record_file.write_text(json.dumps(record, indent=2) + "\n")

    if not args.replot:
        preset = GPU_PRESET if args.preset == "gpu" else CPU_PRESET
        cuda = not transfer.device_description().startswith("CPU")
        record["calls"].append({
            "parts": args.parts,
            "command": shlex.join(["python", "benchmarks/te_fp8.py", *(sys.argv[1:] if argv is None else argv)]),
            "commit": os.environ.get("BENCH_GIT_COMMIT") or git_commit(),  # a device's copy of the tree has no .git
            "device": transfer.device_description(),
        })  # fmt: skip
        if "layers" in args.parts:
            record["numerics"] = fp8_numerics()
            print(record["numerics"], flush=True)
            save()
            record["layers"] = layer_timings()
            save()
        work = out / "work"
        data = work / f"fashion-mnist-{args.preset}"
        if set(args.parts) & set(PARTS) and not (data / "data" / "train-00000-of-00001.parquet").is_file():
            try:
                transfer.build_fashion_mnist(args.fashion_mnist, data, preset.train, preset.validation, preset.test)
            except transfer.MissingData as err:
                parser.exit(2, f"error: {err}\n")
        for part in (p for p in args.parts if p in PARTS):
            record["runs"] = [r for r in record["runs"] if r["part"] != part]
            runs(part, preset, args.modes, work, data, cuda, record["runs"], save)  # saved after each run
        save()
    (out / "te_fp8.md").write_text(markdown(record))
    print(markdown(record))
    try:
        chart(record, out / "loss_curves.png")
    except ImportError:  # a GPU machine without matplotlib: --replot where the record lands
        print(f"matplotlib missing: draw loss_curves.png with --replot --out {out}")
    return record


if __name__ == "__main__":
    main()
