# syntax=docker/dockerfile:1
# kvindex service image. Build: docker build -t kvindex:0.1.0 .
# The build stage builds kvindex's wheel (with its compiled table kernels,
# indexer/memory/_probe.c, and hash chain, indexer/_chain.c) and every dependency's wheel on the
# full Python image, which has a C compiler and libssl-dev (buildpack-deps); the final
# stage installs them offline on the slim image of the same Python and Debian release,
# whose libssl3 (Python's ssl module needs it) the hash chain links against, so no
# compiler, build backend or download reaches the image.
# The image also holds the tokenizer of each model in TOKENIZER_MODELS, so the gateway
# and text prompts route by cache with nothing downloaded at run time (deploy/README.md,
# "Tokenizers"): fetched from the Hugging Face Hub at build time, or, air-gapped, taken
# from a local folder with --build-context tokenizers=DIR (one folder per model id).
# tests/test_dockerfile.py runs these exact RUN and ENTRYPOINT commands.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG BUILD_IMAGE=python:3.11-bookworm

FROM ${BUILD_IMAGE} AS tokenizer-download
# Space-separated hub ids, each optionally @revision (a commit, for a reproducible image).
ARG TOKENIZER_MODELS=Qwen/Qwen3-0.6B
ARG HF_ENDPOINT=https://huggingface.co
WORKDIR /tokenizers
# A gated model needs a token: docker build --secret id=hf_token,src=$HOME/.cache/huggingface/token
RUN --mount=type=secret,id=hf_token \
    set -eu; \
    auth=""; [ -s /run/secrets/hf_token ] && auth="Authorization: Bearer $(cat /run/secrets/hf_token)"; \
    for entry in ${TOKENIZER_MODELS}; do \
      model="${entry%@*}"; revision=main; \
      case "$entry" in *@*) revision="${entry##*@}";; esac; \
      mkdir -p "$model"; \
      for file in tokenizer.json tokenizer_config.json; do \
        curl -fsSL ${auth:+-H "$auth"} -o "$model/$file" "${HF_ENDPOINT}/$model/resolve/$revision/$file"; \
      done; \
      for file in chat_template.jinja special_tokens_map.json; do \
        curl -fsSL ${auth:+-H "$auth"} -o "$model/$file" "${HF_ENDPOINT}/$model/resolve/$revision/$file" \
          || rm -f "$model/$file"; \
      done; \
    done

# What the image gets: <model id>/tokenizer.json (+ its config and chat template) per
# model. --build-context tokenizers=DIR replaces this stage with DIR.
FROM scratch AS tokenizers
COPY --from=tokenizer-download /tokenizers/ /

FROM ${BUILD_IMAGE} AS build
ARG EXTRAS=k8s,redis,tokenize
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY events/ events/
COPY indexer/ indexer/
COPY scoring/ scoring/
COPY api/ api/
RUN --mount=type=cache,target=/root/.cache/pip pip wheel --wheel-dir /wheels ".[${EXTRAS}]"

FROM ${PYTHON_IMAGE}
ARG EXTRAS=k8s,redis,tokenize
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVINDEX_LISTEN=0.0.0.0:8080
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels pip install --no-cache-dir --no-index --find-links /wheels "kvindex[${EXTRAS}]"
# deploy/base/configmap.yaml names each model's folder here (`tokenizer:`).
COPY --from=tokenizers / /opt/kvindex/tokenizers/
USER 65532:65532
EXPOSE 8080 5557
ENTRYPOINT ["kvindex", "serve"]
