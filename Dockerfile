# qurl GPU image: the SGLang release image (CUDA, torch, sglang, flashinfer, sgl-kernel; pinned by
# tag) + megatron-core + qurl. The trainer (`qurl ...`) and the rollout servers
# (`python -m sglang.launch_server ...`, see `qurl launch --dry-run`) run from the same image, so the
# learner and SGLang share one torch build -- the weight-update group relies on it (qurl/weights/group.py).
#   docker build -t qurl:0.1.0 .
#   docker run --gpus all --ipc=host --network=host -v /shared:/shared qurl:0.1.0 train --preset ...
# sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0; qurl's adapter was written against it.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PIP_NO_CACHE_DIR=1

# qurl's own dependencies, pinned to the versions its CPU test suite runs with. torch,
# transformers, tokenizers, safetensors, numpy and pyzmq come from the SGLang image and are not
# touched (no --upgrade, and qurl itself is installed with --no-deps).
RUN python -m pip install \
        "megatron-core==0.16.1" \
        "gguf==0.19.0" \
        "blake3==1.0.11" \
        "math-verify==0.9.0" \
        "pyarrow==26.0.1" \
        "matplotlib==3.11.2" \
        "tqdm==4.70.1" \
        "wandb==0.31.0"

WORKDIR /opt/qurl
COPY pyproject.toml README.md ./
COPY qurl ./qurl
COPY megatron_patches ./megatron_patches
RUN python -m pip install --no-deps . \
    && python -c "import qurl, qurl.engines.sglang.engine, qurl.engines.sglang.inside.loader, qurl.learner.megatron, sglang; print('qurl + sglang', sglang.__version__)"
# The servers import qurl.engines.sglang.inside.loader (--custom-weight-loader, planned by `qurl launch`
# for w8a8_int8 / w8a8_fp8): qurl must be importable by the image's python, as it is above.
COPY scripts ./scripts

ENTRYPOINT ["qurl"]
CMD ["--help"]
