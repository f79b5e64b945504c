"""The Trainer (trainer) and the bases it is built from: our loss and the NaN/inf rule (loss), the end of train()
(stopping), checkpoints complete or absent (checkpoint_io), with the speed meter (meter), what the Trainer reports
(observability), the run's phases (timeline) and accelerate's unwrap without DeepSpeed's import (lazy_deepspeed). It
may import publish/, plan/, model/, data/ and core/."""
