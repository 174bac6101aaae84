# Every target sets itself up on a fresh machine: a venv in .venv with hpctrain, the PyPI MPICH,
# the test tools and Numba (the fused kernels; tests/test_nn_fused.py checks them against NumPy).
# Re-running is quick: the stamp file skips pip when pyproject is unchanged.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP  := $(VENV)/.installed
# Each test gets a timeout (pyproject sets 180 s; the suite runs far under it). MPI runs
# go through `python -m mpi4py` so an exception on one rank aborts the whole job.
PYTEST_MPI := -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider
MPIFLAGS ?=

.PHONY: venv test test-serial test-mpi2 test-mpi4 test-mpi8 test-slurm demo bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpich,test,fast]'
	touch $(STAMP)

test: test-serial test-mpi2 test-mpi4 test-mpi8

test-serial: venv
	$(PY) -m pytest -q -p no:cacheprovider

test-mpi2: venv
	$(MPIEXEC) $(MPIFLAGS) -n 2 $(PY) $(PYTEST_MPI)

test-mpi4: venv
	$(MPIEXEC) $(MPIFLAGS) -n 4 $(PY) $(PYTEST_MPI)

# dp=2 x tp=2 x pp=2: only the composition's equivalence tests and the README's -n 8 job shape
# (8 ranks oversubscribe small machines).
test-mpi8: venv
	$(MPIEXEC) $(MPIFLAGS) -n 8 $(PY) $(PYTEST_MPI) tests/test_parallelize.py \
	  "tests/test_short_batch.py::test_short_last_batch_trains_like_one_process[gpt-tp2-pp2]"

# A real single-node Slurm on this machine (tests/test_slurm.py): Debian's slurmctld, slurmd and
# munge are installed when missing (needs root and apt-get; otherwise the test skips and says why).
SLURM_PKGS := slurmctld slurmd slurm-client munge
test-slurm: venv
	@if ! command -v slurmctld >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmctld ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(SLURM_PKGS)"; \
	    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -q --no-install-recommends $(SLURM_PKGS) >/dev/null; \
	  else echo "Slurm is not installed and this is not root with apt-get: the test will skip"; fi; \
	fi
	HPCTRAIN_TEST_SLURM=1 $(PY) -m pytest -q -p no:cacheprovider -m slurm tests/test_slurm.py
	# Two nodes: network namespaces on this machine, one slurmd each (root; skips without, saying why).
	HPCTRAIN_TEST_NETNS=1 $(PY) -m pytest -q -p no:cacheprovider -m slurm tests/test_two_nodes.py

# The main job: an MLP classifier on the built-in HDF5 set, data parallel on 2 ranks.
demo: venv
	$(MPIEXEC) -n 2 $(VENV)/bin/hpctrain train

# Every benchmarks/*.py (each under mpiexec with --markdown) into one regenerated REPORT.md.
# BENCHFLAGS: e.g. --quick, --np 4, --only ddp pipeline.
BENCHFLAGS ?=
bench: venv
	$(PY) benchmarks/report.py --mpiexec $(MPIEXEC) --out benchmarks/REPORT.md $(BENCHFLAGS)

lint: venv
	$(VENV)/bin/ruff check hpctrain tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
