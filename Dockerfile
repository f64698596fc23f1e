# ctj images. Three targets (BuildKit, the default builder of Docker 23+):
#   docker build --target operator -t ghcr.io/ctj/operator:0.1.0 .
#   docker build --target sidecar  -t ghcr.io/ctj/sidecar:0.1.0 .
#   docker build --target trainer  -t ghcr.io/ctj/trainer:0.1.0 .
# Versions come from requirements/dev.txt (the one place pins live): each deps stage
# installs exactly the packages it names, at the version pinned there, and fails if one
# has no pin. See docs/deploy.md. hack/containers/images.sh builds them here, with no
# registry, FROM a Debian base made by debootstrap (PYTHON_IMAGE below).
#
# Layers: each target's venv is installed in place (never copied between stages, which
# would store torch's ~5 GB twice), under our code, which changes most. The trainer's venv
# is the sidecar's plus a torch layer, so a node running both holds the sidecar's once.
# The operator and sidecar venvs keep no pip (nothing installs into them at run time).
# pip's downloads stay in a BuildKit cache mount, out of the image.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A numeric UID, so runAsNonRoot can verify it (the chart runs as 65532 too).
RUN groupadd --gid 65532 ctj \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /app --shell /usr/sbin/nologin ctj
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app
WORKDIR /app

# --- dependencies: a venv per target, /opt/venv ------------------------------------------

FROM base AS operator-deps
# The operator imports only these, the contract and itself (tests/unit/test_chart_files.py
# checks its imports): no torch, no S3 client, no checkpoint engine.
ARG OPERATOR_PACKAGES="kopf kubernetes prometheus-client"
COPY requirements/dev.txt /tmp/dev.txt
RUN --mount=type=cache,target=/root/.cache/pip,id=ctj-pip set -eu; \
    for p in $OPERATOR_PACKAGES; do grep -E "^${p}(\[[^]]*\])?==" /tmp/dev.txt \
      || { echo "no pin for $p in requirements/dev.txt" >&2; exit 1; }; done > /tmp/pins.txt; \
    python -m venv /opt/venv; \
    /opt/venv/bin/pip install -r /tmp/pins.txt; \
    /opt/venv/bin/pip uninstall -q -y pip setuptools

FROM base AS sidecar-deps
# The checkpoint sidecar (python -m trainer_sidecar sidecar) and the CLI's store commands
# (ctj checkpoints ls|show|gc|rm): the engine's dependencies without torch
# (tests/unit/test_torch_free.py checks that they import none).
ARG SIDECAR_PACKAGES="numpy boto3 blake3 zstandard tqdm prometheus-client kubernetes grpcio"
COPY requirements/dev.txt /tmp/dev.txt
RUN --mount=type=cache,target=/root/.cache/pip,id=ctj-pip set -eu; \
    for p in $SIDECAR_PACKAGES; do grep -E "^${p}(\[[^]]*\])?==" /tmp/dev.txt \
      || { echo "no pin for $p in requirements/dev.txt" >&2; exit 1; }; done > /tmp/pins.txt; \
    python -m venv /opt/venv; \
    /opt/venv/bin/pip install -r /tmp/pins.txt; \
    /opt/venv/bin/pip uninstall -q -y pip setuptools

FROM sidecar-deps AS trainer-deps
# The sidecar's venv plus torch (and safetensors), in a layer of their own. pip comes back
# (ensurepip) and stays: users extend this image with their training code's packages.
# torch from PyPI is the CUDA build; for a CPU-only image pass
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG TRAINER_PACKAGES="safetensors"
RUN --mount=type=cache,target=/root/.cache/pip,id=ctj-pip set -eu; \
    grep -E "^torch==" /tmp/dev.txt > /tmp/torch.txt \
      || { echo "no pin for torch in requirements/dev.txt" >&2; exit 1; }; \
    for p in $TRAINER_PACKAGES; do grep -E "^${p}(\[[^]]*\])?==" /tmp/dev.txt \
      || { echo "no pin for $p in requirements/dev.txt" >&2; exit 1; }; done > /tmp/pins.txt; \
    /opt/venv/bin/python -m ensurepip --default-pip >/dev/null; \
    /opt/venv/bin/pip install --index-url "$TORCH_INDEX_URL" -r /tmp/torch.txt; \
    /opt/venv/bin/pip install -r /tmp/pins.txt

# --- final images: the venv, our code in /app, a non-root user --------------------------

FROM operator-deps AS operator
COPY contract/ctj_contract/ /app/ctj_contract/
COPY operator/ctj_operator/ /app/ctj_operator/
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "ctj_operator"]

FROM sidecar-deps AS sidecar
COPY contract/ctj_contract/ /app/ctj_contract/
COPY trainer_sidecar/ /app/trainer_sidecar/
# `ctj checkpoints ls|show|gc|rm` work here too (verify and export need torch: the trainer)
RUN printf '#!/bin/sh\nexec python -m trainer_sidecar "$@"\n' > /usr/local/bin/ctj \
    && chmod 0755 /usr/local/bin/ctj
USER 65532:65532
EXPOSE 9400
# The operator gives the command (python -m trainer_sidecar sidecar --metrics-port 9400);
# this default is the same daemon, configured by CTJ_* variables.
CMD ["python", "-m", "trainer_sidecar", "sidecar"]

FROM trainer-deps AS trainer
COPY contract/ctj_contract/ /app/ctj_contract/
COPY trainer_sidecar/ /app/trainer_sidecar/
COPY examples/ /app/examples/
# `ctj ...` as in the README (the same as python -m trainer_sidecar)
RUN printf '#!/bin/sh\nexec python -m trainer_sidecar "$@"\n' > /usr/local/bin/ctj \
    && chmod 0755 /usr/local/bin/ctj
USER 65532:65532
# No entrypoint: the pod gives the command (the training script, or the sidecar's
# `python -m trainer_sidecar sidecar ...`).
CMD ["python"]
