# Two commands do everything on a fresh machine:
#   make demo   create .venv, install, train the CPU default config on an embedded Ray cluster
#   make test   create .venv, install with the dev extra, run the test suite
# On a GPU machine whose system Python already has CUDA torch:  make test-gpu

VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-dev

.PHONY: demo test test-gpu clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	@# Without a GPU, take the CPU build of torch first (otherwise torch>=2.11 pulls a multi-GB CUDA build), and the
	@# triton the kernels are compiled with on the GPU machines: its interpreter runs the kernel tests on the CPU
	@# (triton 3.9's interpreter refuses masks they use). With a GPU, the CUDA torch names its own triton.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) -m pip install -q torch==2.13.0 triton==3.6.0; fi
	$(PYTHON) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/archipelago fit examples/cpu-tiny.toml --overwrite

# pytest exits 5 when it collects no tests; make treats any non-zero exit as a failure.
# lint-imports holds the layers of ARCHITECTURE.md: an import back up the stack fails the build.
# -rs prints why each skipped test skipped (under CI=true only gpu-marked tests may: tests/conftest.py).
# Two pytest processes side by side on the two cores, each with its own local Ray cluster: one runs the
# integration tests that share the uninterrupted run and the S3 server, or kill and time workers and
# drivers, one after another (a new integration file goes there by default); the other runs the unit
# tests, then the integration files listed in INTEGRATION_BESIDE_UNIT, which need neither. The first
# process's log prints when both have ended. (pytest-xdist's --dist loadgroup cannot keep the Ray tests
# together under pytest 9: it renames tests through a field pytest 9 no longer reads.) The split keeps the two
# about even: on 2026-12-06 (2-core VM, fresh clone) the first took 15.4 min and the second 17.2, with
# test_workloads.py moved to the second (before: 28 and 18.5).
INTEGRATION_BESIDE_UNIT := $(addprefix tests/integration/,test_adaptive_batch.py test_hf_models.py \
	test_island_placement.py test_overlap_fit.py test_topology_discover.py test_job_submit.py test_workloads.py)
INTEGRATION_LOG := $(VENV)/integration-tests.log
test: $(STAMP)
	$(VENV)/bin/lint-imports
	@$(PYTHON) -m pytest --timeout=900 --durations=10 -rs tests/integration \
	    $(addprefix --ignore=,$(INTEGRATION_BESIDE_UNIT)) > $(INTEGRATION_LOG) 2>&1 & integration=$$!; \
	$(PYTHON) -m pytest --timeout=900 --durations=10 -rs tests/unit tests/gpu $(INTEGRATION_BESIDE_UNIT); unit=$$?; \
	wait $$integration; integration=$$?; \
	echo "================ tests/integration (ran beside the unit tests) ================"; \
	cat $(INTEGRATION_LOG); \
	echo "unit tests and $(words $(INTEGRATION_BESIDE_UNIT)) integration files: exit $$unit; other integration tests: exit $$integration"; \
	test $$unit -eq 0 && test $$integration -eq 0

test-gpu:
	PYTHONPATH=.:$$PYTHONPATH python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -rs

clean:
	rm -rf $(VENV) runs .pytest_cache
