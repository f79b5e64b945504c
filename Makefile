# Two commands a fresh machine needs: `make demo` and `make test`. Both install first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# A CPU machine gets this torch; a machine that already has torch (e.g. a CUDA build) keeps its own.
TORCH_VERSION ?= 2.13.0
DEMO_DIR ?= data/digits
DEMO_OUT ?= outputs/digits-vit

.PHONY: install demo test style quality clean

.installed: setup.cfg pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -e ".[dev,demo]"
	@touch .installed

install: .installed

demo: .installed
	$(PYTHON) -m vit_recipes.demo_data $(DEMO_DIR)
	$(PYTHON) run_image_classification.py --config recipes/quickstart/digits.yaml \
		--dataset_name $(DEMO_DIR) --output_dir $(DEMO_OUT) --overwrite_output_dir

test: .installed
	$(PYTHON) -m pytest tests -q

style: .installed
	ruff format .
	ruff check --fix .

quality: .installed
	ruff format --check .
	ruff check .

clean:
	rm -rf .installed build dist src/*.egg-info outputs .pytest_cache .ruff_cache
