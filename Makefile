# `make demo` and `make test` set up .venv themselves on a fresh machine
# (Python 3.11, pip, Debian's apt).
VENV  := .venv
PY    := $(VENV)/bin/python
CORE  := $(VENV)/.stamp-core
FULL  := $(VENV)/.stamp-full
DSOPS := $(VENV)/.stamp-deepspeed-ops

.PHONY: demo test bench redis-server clean

AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob

PIP   := $(PY) -m pip install -q -c constraints.txt

# Every pip call takes constraints.txt: the exact versions the suite is tested with (the package
# metadata declares only ranges). torch first, on its own: its pin there (torch==2.13.0) takes the
# local CPU wheel, so nothing after it pulls a CUDA build.
$(CORE): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch numpy
	$(PIP) -e ".[torch,redis]"
	touch $@

# every framework the suite tests against (about 2.4 GB)
# torchtitan without its dependencies (they would replace numpy and add wandb, datasets, ...):
# its checkpoint, optimizer and dataloader modules need only torch, torchdata, tyro and
# spmd-types, which the test extra brings (tests/titan; 16 MB)
$(FULL): $(CORE)
	$(PIP) -e ".[test]"
	$(PIP) --no-deps torchtitan
	touch $@

# DeepSpeed compiles its CPU communication op (deepspeed_shm_comm) on its first init_distributed:
# about a minute of both cores. Once here, not inside whichever test comes first, and into the venv,
# not ~/.cache/torch_extensions: that folder outlives a clone, and a build killed there leaves its
# lock file, on which every later build waits forever (stop 50's CI hung there for 80 minutes).
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch-extensions
$(DSOPS): $(FULL)
	rm -rf $(TORCH_EXTENSIONS_DIR)
	DS_ACCELERATOR=cpu timeout 900 $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)"
	touch $@

APT   := SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); apt() { $$SUDO apt-get install -y -q "$$@" >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q "$$@" >/dev/null; }; }; apt

redis-server:
	@command -v redis-server >/dev/null || { $(APT) redis-server; }

# Azure's storage emulator for tests/objectstore/test_object_azure.py (Node.js and npm from apt if missing)
$(AZURITE):
	@command -v npm >/dev/null || { $(APT) nodejs npm; }
	npm install --silent --no-fund --no-audit --prefix $(VENV)/azurite azurite@3.35.0

demo: $(CORE)
	$(PY) examples/demo.py

# two workers (CI has two cores); tests/conftest.py keeps what a session starts once together
test: $(FULL) $(DSOPS) redis-server $(AZURITE)
	$(PY) -m pytest tests -n 2 --dist loadfile

bench: $(CORE)
	$(PY) benchmarks/save_load.py

clean:
	rm -rf $(VENV) build *.egg-info
