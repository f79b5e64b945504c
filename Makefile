# Two commands a fresh machine needs: `make demo` and `make test`. Both install first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# A CPU machine gets this torch; a machine that already has torch (e.g. a CUDA build) keeps its own.
TORCH_VERSION ?= 2.13.0
DEMO_DIR ?= data/digits
DEMO_OUT ?= outputs/digits-vit

.PHONY: install demo test test-gpu mutate bench index style quality clean

# Test files run on one worker process per core, at most 4 (pytest-xdist), each file's tests on one worker, in
# order, so its shared fixtures are built once (test_distributed.py's slowest tests form two more groups), the
# slowest groups first; each worker's torch takes its share of the cores (tests/conftest.py).
# One process left cores idle while tests waited on launched processes. TEST_WORKERS=1: one process.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))")

# What a run needs, and scikit-learn for the demo's data.
.installed: setup.cfg pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -e ".[demo]"
	@touch .installed

# What the tests need on top: dev tools, torchao (tests/test_fp8.py emulates FP8 on the CPU) and DeepSpeed.
.installed-test: .installed
	$(PIP) install -e ".[dev,demo,fp8]"
# DeepSpeed without prebuilt ops and without build isolation: an isolated build would fetch a CUDA torch.
	DS_BUILD_OPS=0 $(PIP) install --no-build-isolation "deepspeed>=0.19.8,<0.20"
# CPU-only machines: compile DeepSpeed's shared-memory collective now, not in the first test (no-op on GPUs).
	$(PYTHON) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	@touch .installed-test

install: .installed-test

demo: .installed
	$(PYTHON) tools/demo_data.py $(DEMO_DIR)
	$(PYTHON) run_image_classification.py --config recipes/quickstart/digits.yaml \
		--dataset_name $(DEMO_DIR) --output_dir $(DEMO_OUT) --overwrite_output_dir

test: .installed-test
	@$(PYTHON) -c "from importlib.metadata import version as v; print('resolved:', ', '.join(f'{p} {v(p)}' for p in \
		('torch transformers datasets accelerate peft evaluate huggingface_hub deepspeed safetensors pillow numpy pyarrow'.split())))"
	$(PYTHON) -m pytest tests -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The GPU acceptance suite (docs/development.md): every strategy, checkpoint path and one-GPU feature on this
# machine's GPUs, written to benchmarks/results/<date>_acceptance_<gpus>x<card>/. PARTS=strategies,kill picks parts.
test-gpu:
	$(PYTHON) -c "import deepspeed, datasets, evaluate, vit_recipes" 2>/dev/null || $(PIP) install -e ".[deepspeed]"
	$(PYTHON) benchmarks/acceptance.py $(if $(PARTS),--parts $(PARTS)) $(if $(RECORD),--record $(RECORD))

# Do the tests catch a removed behaviour? Each one-line mutation tools/mutations.yaml lists for MODULES (all listed
# without it), applied alone to a copy of src/, with the fast tests named for it: killed or survived, into
# outputs/mutate/last.json and .md (docs/development.md). ARGS adds options (ARGS="--ids streaming/repeats").
mutate: .installed-test
	$(PYTHON) tools/mutate.py $(if $(MODULES),--modules $(MODULES)) $(ARGS)

# One benchmark suite (benchmarks/suites/SUITE.yaml) on this machine, into a record folder of benchmarks/results/
# (docs/benchmarks.md); ARGS adds runner options (ARGS="--gpus 2 --only ddp"). Without SUITE: the suites and questions.
bench:
	$(PYTHON) -m benchmarks.run $(if $(SUITE),$(SUITE) $(ARGS),--list)

# benchmarks/results/README.md, the index of the records, written again from the record folders.
index:
	$(PYTHON) -m benchmarks.index

style: .installed-test
	ruff format .
	ruff check --fix .

quality: .installed-test
	ruff format --check .
	ruff check .

clean:
	rm -rf .installed .installed-test build dist src/*.egg-info outputs .pytest_cache .ruff_cache
