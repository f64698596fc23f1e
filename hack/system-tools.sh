#!/usr/bin/env bash
# System packages the tests use, from Debian's archive: promtool (package
# prometheus) checks our metrics' exposition format. Idempotent; needs root
# (CI runs as root) the first time.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1; then
  echo "ctj: installing promtool (Debian package prometheus)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
