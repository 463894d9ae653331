# `make demo` and `make test` set up .venv themselves on a fresh machine
# (Python 3.11, pip, Debian's apt).
VENV  := .venv
PY    := $(VENV)/bin/python
CORE  := $(VENV)/.stamp-core
FULL  := $(VENV)/.stamp-full

.PHONY: demo test bench redis-server clean

# torch first, pinned exactly: that takes the local CPU wheel, so nothing pulls a CUDA build
$(CORE): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 "numpy==1.26.4"
	$(PY) -m pip install -q -e ".[torch,redis]"
	touch $@

# every framework the suite tests against (about 2.4 GB)
# torchtitan without its dependencies (they would replace numpy and add wandb, datasets, ...):
# its checkpoint, optimizer and dataloader modules need only torch, torchdata, tyro and
# spmd-types, which the test extra brings (tests/titan; 16 MB)
$(FULL): $(CORE)
	$(PY) -m pip install -q -e ".[test]" torch==2.13.0 "numpy==1.26.4"
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0
	touch $@

redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q redis-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q redis-server >/dev/null; }; }

demo: $(CORE)
	$(PY) examples/demo.py

# two workers (CI has two cores); tests/conftest.py keeps what a session starts once together
test: $(FULL) redis-server
	$(PY) -m pytest tests -n 2 --dist loadgroup

bench: $(CORE)
	$(PY) benchmarks/save_load.py

clean:
	rm -rf $(VENV) build *.egg-info
