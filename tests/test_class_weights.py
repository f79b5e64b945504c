"""--class_weights: the mechanism, in-process and fast. `balanced` weights the training loss (with and without
mixup/cutmix), `balanced_sampler` draws every class equally often. That they lift the minority classes of a real
run is test_script.py's end-to-end test."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_vit_config
from datasets import Dataset
from transformers import TrainingArguments

from vit_recipes.data.data import ImageSplits, balanced_sample_weights
from vit_recipes.data.transforms import MixupCutmix
from vit_recipes.train.trainer import ImageClassificationTrainer

NUM_LABELS = 4
WEIGHTS = torch.tensor([0.25, 1.0, 2.0, 4.0])


def tiny_model():
    from transformers import ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(tiny_vit_config(NUM_LABELS))  # no dropout: the same pixels, the same logits


def trainer(tmp_path, model=None, seed=42, **kwargs) -> ImageClassificationTrainer:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", seed=seed,
                             per_device_train_batch_size=100, remove_unused_columns=False)  # fmt: skip
    return ImageClassificationTrainer(model=model if model is not None else tiny_model(), args=args, **kwargs)


class Recorded:
    """The run's mixer (MixupCutmix), keeping what it hands the loss: the mixed pixels and their soft targets."""

    def __init__(self, mixer):
        self.mixer, self.pixels, self.targets = mixer, None, None

    def __call__(self, pixels, labels, randomness=None):
        self.pixels, self.targets = self.mixer(pixels, labels, randomness)
        return self.pixels, self.targets


def batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])  # each unlike its mixing partner, the flip
    return {"pixel_values": torch.randn(len(labels), 3, 16, 16, generator=generator), "labels": labels}


def test_balanced_class_weights_weight_the_training_loss_and_not_the_evaluation_loss(tmp_path):
    model = tiny_model()
    weighted = trainer(tmp_path, model, class_weights=WEIGHTS)
    inputs = batch()
    with torch.no_grad():
        logits = model(pixel_values=inputs["pixel_values"]).logits
        training = weighted.compute_loss(model.train(), dict(inputs))
        evaluation = weighted.compute_loss(model.eval(), dict(inputs))
    torch.testing.assert_close(training, F.cross_entropy(logits, inputs["labels"], weight=WEIGHTS))
    assert not torch.allclose(training, F.cross_entropy(logits, inputs["labels"]))  # the weights change it
    torch.testing.assert_close(evaluation, F.cross_entropy(logits, inputs["labels"]))  # scored as it is


@pytest.mark.parametrize("mix", ["mixup", "cutmix"])
def test_class_weights_weight_the_soft_targets_of_mixup_and_cutmix(tmp_path, mix):
    """Under mixup/cutmix the loss is soft-target cross-entropy; each class's share of a target counts with its
    class's weight: sum_c w_c * t_c * -log p_c, averaged over the batch."""
    model = tiny_model().train()
    alphas = (0.8, 0.0) if mix == "mixup" else (0.0, 1.0)
    mixer = Recorded(MixupCutmix(*alphas, num_classes=NUM_LABELS))
    weighted = trainer(tmp_path, model, mixup=mixer, class_weights=WEIGHTS)
    random.seed(1)  # outside a training step the mixer draws its lam (and cutmix its box) from Python's generator
    with torch.no_grad():
        loss = weighted.compute_loss(model, batch())
        log_p = F.log_softmax(model(pixel_values=mixer.pixels).logits, dim=-1)
    targets = mixer.targets
    assert targets.shape == (8, NUM_LABELS) and ((targets > 0).sum(-1) == 2).all()  # two classes mixed per image
    torch.testing.assert_close(loss, (-(WEIGHTS * targets) * log_p).sum(-1).mean())
    unweighted = (-targets * log_p).sum(-1).mean()
    assert not torch.allclose(loss, unweighted)  # what the loss was with the weights dropped under mixup


def draws(tmp_path, labels: list[int], seed: int, sample_weights=None) -> list[int]:
    """The labels one epoch of the trainer's training DataLoader delivers, in order."""
    train = Dataset.from_dict({"labels": labels})
    collate = lambda rows: {"labels": torch.tensor([row["labels"] for row in rows])}  # noqa: E731
    loader = trainer(tmp_path, seed=seed, train_dataset=train, data_collator=collate,
                     sample_weights=sample_weights).get_train_dataloader()  # fmt: skip
    return [int(label) for step in loader for label in step["labels"]]


def test_the_balanced_sampler_draws_each_class_equally_often_and_the_same_on_every_rank(tmp_path):
    """1,500 images of class 0 and 500 of class 1: the plain loader delivers each once (a quarter of class 1); the
    balanced sampler draws 2,000 with replacement, half of each class, from a generator seeded with --seed (the
    same draws on every rank, which accelerate then splits)."""
    labels = [0] * 1500 + [1] * 500
    splits = ImageSplits(Dataset.from_dict({"labels": labels}), None, None, "image", ["a", "b"], "ClassLabel")
    weights = balanced_sample_weights(splits)
    assert Counter(draws(tmp_path, labels, seed=42)) == {0: 1500, 1: 500}
    balanced = draws(tmp_path, labels, seed=42, sample_weights=weights)
    counts = Counter(balanced)
    assert sum(counts.values()) == 2000
    # with --seed 42: class 1 drawn 992 times of 2,000 (binomial: 1,000 +- 22); within 3 standard deviations
    assert abs(counts[1] - 1000) < 67, counts
    assert draws(tmp_path, labels, seed=42, sample_weights=weights) == balanced  # seeded: the same draws again
    assert draws(tmp_path, labels, seed=7, sample_weights=weights) != balanced  # by --seed
