# The Python base ctj's Dockerfile builds FROM here (its PYTHON_IMAGE), made from the
# debootstrap base with Debian's own python3 (3.11, as python:3.11-slim): no registry.
ARG BASE=ctj/debian:bookworm
FROM ${BASE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       python3 python3-venv python-is-python3 >/dev/null \
    && rm -rf /var/lib/apt/lists/*
