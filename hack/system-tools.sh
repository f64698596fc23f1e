#!/usr/bin/env bash
# System packages the tests use, from Debian's archive: package prometheus, whose
# promtool checks our metrics' exposition format and alert rules, and whose server
# scrapes the sidecars and evaluates the alerts in the tests. Idempotent; needs root
# (CI runs as root) the first time.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  echo "ctj: installing promtool and prometheus (Debian package prometheus)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
