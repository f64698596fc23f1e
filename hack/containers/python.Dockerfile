# The Python base ctj's Dockerfile builds FROM here (its PYTHON_IMAGE), made from the
# debootstrap base with Debian's own python3 (3.11, as python:3.11-slim): no registry.
# Like Debian's slim images it keeps no apt caches (apt-get update leaves ~80 MB of
# pkgcache.bin/srcpkgcache.bin behind), docs, man pages or translations: every ctj image
# carries this layer. /usr/share/python-wheels stays (ensurepip, the trainer's pip).
ARG BASE=ctj/debian:bookworm
FROM ${BASE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       python3 python3-venv python-is-python3 >/dev/null \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
       /usr/share/doc/* /usr/share/man/* /usr/share/info/* /usr/share/locale/*
