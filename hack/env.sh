#!/usr/bin/env bash
# Source me: builds (once) and activates the project's Python environment.
#
# The venv lives outside the checkout, in ${CTJ_CACHE:-~/.cache/ctj}, keyed by the
# Python version and the hash of requirements/dev.txt, so a fresh clone on a warm
# machine reuses it and a changed pin builds a new one (torch alone is ~4 GB).
# The checkout itself is installed editable, re-pointed when the checkout moves.
set -euo pipefail
_ctj_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_ctj_cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
_ctj_py="${CTJ_PYTHON:-python3}"
_ctj_pyver="$("$_ctj_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
_ctj_key="$(cat "$_ctj_root/requirements/dev.txt" | sha256sum | cut -c1-12)"
CTJ_VENV="$_ctj_cache/venv-py$_ctj_pyver-$_ctj_key"
export CTJ_CACHE="$_ctj_cache" CTJ_VENV

mkdir -p "$_ctj_cache"
exec {_ctj_lock}>"$_ctj_cache/.venv.lock"
flock "$_ctj_lock"  # one build at a time; a second run waits, then finds it built
if [ ! -f "$CTJ_VENV/.complete" ]; then
  echo "ctj: building the Python environment in $CTJ_VENV (first run only; torch is large)" >&2
  rm -rf "$CTJ_VENV.tmp"
  "$_ctj_py" -m venv "$CTJ_VENV.tmp"
  "$CTJ_VENV.tmp/bin/pip" install --disable-pip-version-check -q --upgrade pip >&2
  "$CTJ_VENV.tmp/bin/pip" install --disable-pip-version-check --progress-bar off \
      -r "$_ctj_root/requirements/dev.txt" >&2
  # venvs hard-code their own path: build in .tmp, then rewrite and move into place
  grep -rlF "$CTJ_VENV.tmp" "$CTJ_VENV.tmp/bin" | xargs sed -i "s|$CTJ_VENV.tmp|$CTJ_VENV|g"
  rm -rf "$CTJ_VENV" && mv "$CTJ_VENV.tmp" "$CTJ_VENV"
  touch "$CTJ_VENV/.complete"
fi

# the product (pyproject.toml) and the development harness (hack/pyproject.toml: the local
# clusters and stack helpers the tests, benchmarks and demo import; never shipped)
_ctj_install="$_ctj_root $(cat "$_ctj_root/pyproject.toml" "$_ctj_root/hack/pyproject.toml" \
  | sha256sum | cut -c1-12)"
if [ "$(cat "$CTJ_VENV/.checkout" 2>/dev/null)" != "$_ctj_install" ]; then
  # one after the other: reinstalling an older ctj that still owned the ctj-devcluster
  # script would remove the one ctj-dev had just written
  for _ctj_dist in "$_ctj_root" "$_ctj_root/hack"; do
    "$CTJ_VENV/bin/pip" install --disable-pip-version-check -q --no-deps --no-build-isolation \
        -e "$_ctj_dist" >"$CTJ_CACHE/editable-install.log" 2>&1 \
      || { cat "$CTJ_CACHE/editable-install.log" >&2; return 1; }
  done
  echo "$_ctj_install" > "$CTJ_VENV/.checkout"
fi
exec {_ctj_lock}>&-
# shellcheck disable=SC1091
source "$CTJ_VENV/bin/activate"
set +euo pipefail
