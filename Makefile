# The README's commands. Each target creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

# The wheelhouse for GPU VMs without internet (README, "Workshops on GPU machines without internet"), e.g.
# make wheelhouse WHEELHOUSE_PYTHON="3.12 3.13"; WHEELHOUSE_ARGS="--present-from image.txt" leaves out what the VM
# has already (its `pip list --format=freeze`)
WHEELHOUSE          ?= build/wheelhouse
WHEELHOUSE_SET      ?= course
WHEELHOUSE_PYTHON   ?= 3.12
WHEELHOUSE_PLATFORM ?= manylinux_2_28_x86_64
# make verify-gpu runs with .venv's Python, made as every target makes it; on a VM with its own torch, install the
# course there first (make install-offline) and name that Python: make verify-gpu VERIFY_PYTHON=python3.
# BUDGET_MIN=9: what fits in 9 minutes (default: the whole course); VERIFY_OUT: where it writes (a passed part also ships
# its results to gpulab/reference/)
VERIFY_PYTHON       ?= $(BIN)/python
VERIFY_INSTALL       = $(if $(filter $(BIN)/python,$(VERIFY_PYTHON)),$(STAMP))
VERIFY_OUT          ?= build/verify-gpu
VERIFY_ARGS          = $(PARTS) $(if $(BUDGET_MIN),--budget-min $(BUDGET_MIN))

.PHONY: course test test-browser test-wheelhouse test-versions lab exercises grade notebooks doctor bench clean \
	wheelhouse install-offline verify-gpu verify-gpu-smoke verify-gpu-plan

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[course,dev]"
	touch $@

course: $(STAMP)  ## run every lesson headless into build/ (notebooks + HTML), with a summary table
	$(BIN)/gpulab course

test: $(STAMP)  ## everything CI runs: unit tests, notebooks (nbval, quick mode), exercises, grading
	@# one thread per process: two-thread kernels side by side on two cores stall each other, one-thread ones share
	@# them evenly. Three pytest workers for two cores: with two, the cores sat idle a fifth of the time while workers
	@# waited on kernels starting and stopping and on time limits. Each module (or class) goes whole to one worker, in
	@# collection order, the tests marked long first (tests/conftest.py): xdist's default order puts modules with few
	@# tests last, and the one-test grading of the solutions ran alone at the end. solutions/ are run by the grader's
	@# test (a fresh kernel each, no cell may fail), not a second time by nbval
	$(BIN)/ruff check gpulab tests grading_benchmarks
	GPULAB_QUICK=1 GPULAB_STRICT_WARNINGS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 3 --dist loadscope --no-loadscope-reorder --nbval-lax -p no:cacheprovider --durations=15 --ignore=tests/browser tests notebooks

test-browser: $(STAMP)  ## lesson 00 in JupyterLab in headless Chromium: Run All Cells, no errors, plots; screenshots in build/browser/
	.ci/install-browser
	GPULAB_QUICK=1 GPULAB_STRICT_WARNINGS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:cacheprovider tests/browser

test-wheelhouse: $(STAMP)  ## the wheelhouse for real: PyPI, Pythons 3.11-3.13, an offline install into a venv with torch (~15 min)
	GPULAB_WHEELHOUSE_TEST=1 $(BIN)/python -m pytest -p no:cacheprovider -s tests/test_wheelhouse_offline.py

test-versions: $(STAMP)  ## the quick course on the lowest torch pyproject.toml declares and on the newest the index serves with its torchvision, a venv each in build/torch-versions/ (several GB each, ~40 min)
	$(BIN)/python -m gpulab.commands.torch_versions

wheelhouse: $(STAMP)  ## every wheel the course needs but torch, for WHEELHOUSE_PYTHON on WHEELHOUSE_PLATFORM, then checked offline
	$(BIN)/python -m gpulab.commands.wheelhouse build --set $(WHEELHOUSE_SET) --out $(WHEELHOUSE) --platform $(WHEELHOUSE_PLATFORM) \
		$(foreach v,$(WHEELHOUSE_PYTHON),--python $(v)) $(WHEELHOUSE_ARGS)
	$(BIN)/python -m gpulab.commands.wheelhouse check $(WHEELHOUSE) $(foreach v,$(WHEELHOUSE_PYTHON),--python $(v)) $(WHEELHOUSE_ARGS)

install-offline:  ## on a machine without internet: the course into PYTHON (which has torch) from WHEELHOUSE
	$(PYTHON) -m pip install --no-index --find-links $(WHEELHOUSE) -e ".[$(WHEELHOUSE_SET)]"

verify-gpu: $(VERIFY_INSTALL)  ## on a GPU: the smoke run, then full-mode parts in order of need while BUDGET_MIN lasts; PARTS="smoke 05" picks
	$(VERIFY_PYTHON) -m gpulab.commands.verify verify $(VERIFY_ARGS) --out $(VERIFY_OUT)

verify-gpu-smoke: $(VERIFY_INSTALL)  ## on a GPU: every lesson in quick mode, several at once (a few minutes; ships nothing)
	$(VERIFY_PYTHON) -m gpulab.commands.verify smoke $(PARTS) --out $(VERIFY_OUT)-smoke

verify-gpu-plan: $(VERIFY_INSTALL)  ## what one verify-gpu command would run (on an H100 where there is no GPU), from measured minutes where there are any
	$(VERIFY_PYTHON) -m gpulab.commands.verify verify --dry-run $(VERIFY_ARGS) $(if $(GPU),--gpu "$(GPU)")

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
