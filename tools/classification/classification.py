"""Accuracy, top-k and macro F1/precision/recall, or (config "multilabel") mAP, micro/macro F1 and exact match: a
local `evaluate` module, so evaluation works offline (unlike `evaluate.load("accuracy")`), loaded by path:
`evaluate.load("tools/classification")`. Its arithmetic is the package's (vit_recipes.core.metrics, which a run calls
directly), so it needs vit_recipes installed."""

import datasets
import evaluate

from vit_recipes.core.metrics import classification_scores

_DESCRIPTION = """\
accuracy; top{k}_accuracy (the reference among the k = min(top_k, num_classes) highest scores); f1_macro,
precision_macro, recall_macro (unweighted means over the classes in references or predictions: scikit-learn's
average="macro", zero_division=0), from per-class scores (logits or probabilities)."""
_KWARGS_DESCRIPTION = """predictions: one row of num_classes scores per sample; references: class ids in
[0, num_classes); top_k (default 5): the k of top{top_k}_accuracy. Returns those five floats in [0, 1].
Config "multilabel": logits and multi-hot references; predicted: sigmoid >= threshold (default 0.5). Returns
mean_average_precision (scikit-learn's average_precision_score per class, averaged over the classes with a positive in
references: classes without one have no AP and are left out), f1_micro, f1_macro (zero_division=0, every class) and
subset_accuracy (exact match)."""
_CITATION = "Pedregosa et al., Scikit-learn: Machine Learning in Python, JMLR 12, pp. 2825-2830, 2011."


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Classification(evaluate.Metric):
    def _info(self):
        scores = datasets.Sequence(datasets.Value("float32"))
        references = scores if self.config_name == "multilabel" else datasets.Value("int64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": scores, "references": references}),
            reference_urls=["https://scikit-learn.org/stable/modules/model_evaluation.html"],
        )

    def _compute(self, predictions, references, top_k: int = 5, threshold: float = 0.5):
        return classification_scores(predictions, references, self.config_name == "multilabel", top_k, threshold)
