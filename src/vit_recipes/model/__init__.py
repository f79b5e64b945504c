"""The model: what a run knows of it, read once (facts: the config, its classifier class, the image processor's
size, the parameter count), building it full, LoRA or head only (modeling, lora, classifiers), what changes a built
model (patch_embedding, patch_dropout, fp8, levers, attention's sdpa_direct), saving, merging and loading the final
model back (adapters), and its FLOPs per image (flops). It may import core/ only."""
