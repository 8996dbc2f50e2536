# syntax=docker/dockerfile:1
# kvindex service image. Build: docker build -t kvindex:0.1.0 .
# Stage 1 builds kvindex's wheel (with its compiled table kernels, indexer/_probe.c, and
# hash chain, indexer/_chain.c) and every dependency's wheel on the full Python image,
# which has a C compiler and libssl-dev (buildpack-deps); stage 2 installs them offline
# on the slim image of the same Python and Debian release, whose libssl3 (Python's ssl
# module needs it) the hash chain links against, so no compiler, build backend or
# download reaches the image.
# tests/test_dockerfile.py runs these exact RUN and ENTRYPOINT commands.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG BUILD_IMAGE=python:3.11-bookworm

FROM ${BUILD_IMAGE} AS build
ARG EXTRAS=k8s,redis
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY events/ events/
COPY indexer/ indexer/
COPY scoring/ scoring/
COPY api/ api/
RUN --mount=type=cache,target=/root/.cache/pip pip wheel --wheel-dir /wheels ".[${EXTRAS}]"

FROM ${PYTHON_IMAGE}
ARG EXTRAS=k8s,redis
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVINDEX_LISTEN=0.0.0.0:8080
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels pip install --no-cache-dir --no-index --find-links /wheels "kvindex[${EXTRAS}]"
USER 65532:65532
EXPOSE 8080 5557
ENTRYPOINT ["kvindex", "serve"]
