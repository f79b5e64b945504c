"""The ground every other folder stands on, knowing nothing of a dataset, a model or a Trainer: the one error type
(errors), every argument dataclass and the YAML recipes (arguments), the process against its launcher and GPUs
(launch), stop signals (interrupt), the Hub's checks and one-line errors (hub), a field swapped around one upstream
call (swap), and the classification metric with the label of a row left out (metrics: decoding, the loss and the
reports share it). These sit here, below the folders named after their users, because data/, model/, plan/ and
publish/ all import them. It imports nothing else of the package."""
