"""What a run leaves for people to read: the model card (card), the per-class reports and confusion matrix (reports),
the training plots (plots) and the child processes that draw them while it evaluates (figures). It may import data/
and core/."""
