# The README's commands. Each target creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: course test test-browser lab exercises grade notebooks doctor bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[course,dev]"
	touch $@

course: $(STAMP)  ## run every lesson headless into build/ (notebooks + HTML), with a summary table
	$(BIN)/gpulab course

test: $(STAMP)  ## everything CI runs: unit tests, notebooks (nbval, quick mode), exercises, grading
	@# two pytest workers, one thread each: two-thread kernels side by side on two cores stall each other
	$(BIN)/ruff check gpulab tests
	GPULAB_QUICK=1 GPULAB_STRICT_WARNINGS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadscope --nbval-lax -p no:cacheprovider --ignore=tests/browser tests notebooks solutions

test-browser: $(STAMP)  ## lesson 00 in JupyterLab in headless Chromium: Run All Cells, no errors, plots; screenshots in build/browser/
	.ci/install-browser
	GPULAB_QUICK=1 GPULAB_STRICT_WARNINGS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:cacheprovider tests/browser

lab: $(STAMP)  ## open JupyterLab on the lessons
	$(BIN)/jupyter lab notebooks/

exercises: $(STAMP)  ## regenerate exercises/ from solutions/
	$(BIN)/gpulab exercises build

grade: $(STAMP)  ## grade notebooks: make grade NOTEBOOKS="submissions/*.ipynb"
	$(BIN)/gpulab grade $(or $(NOTEBOOKS),exercises/*.ipynb)

notebooks: $(STAMP)  ## strip outputs and rewrite setup cells of every notebook
	$(BIN)/gpulab notebooks

doctor: $(STAMP)
	$(BIN)/gpulab doctor

bench: $(STAMP)
	$(BIN)/gpulab bench

clean:
	rm -rf build grades results .pytest_cache
