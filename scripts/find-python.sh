#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter, or explain how to get one (exit 1).
#
# Order: $PYTHON if set; python3.12 / python3.13 on PATH, only if they actually run
# (a pyenv shim can exist yet fail when that version is not selected); pyenv's installed
# versions ($(pyenv root), else $PYENV_ROOT or ~/.pyenv); /usr/bin and /usr/local/bin.
# Within each group 3.12 (the version the project is tested on) comes first, then newer
# versions, highest first, so that a fresh CI clone and a developer's .venv agree.
set -u

works() {
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

candidates=()

# Installed versions under a pyenv root: 3.12.x (newest first), then 3.13+ (highest first).
add_pyenv_root() {
  local root=$1 dir
  [ -d "$root/versions" ] || return 0
  for dir in $(ls -d "$root"/versions/3.12* 2>/dev/null | sort -rV) \
             $(ls -d "$root"/versions/3.1[3-9]* 2>/dev/null | sort -rV); do
    candidates+=("$dir/bin/python")
  done
}

if [ -n "${PYTHON:-}" ]; then
  if works "$PYTHON"; then
    command -v "$PYTHON"
    exit 0
  fi
  echo "find-python: PYTHON=$PYTHON is not a working Python >= 3.12; looking elsewhere." >&2
fi

for name in python3.12 python3.13 python3.14 python3; do
  path=$(command -v "$name" 2>/dev/null) && candidates+=("$path")
done

if command -v pyenv >/dev/null 2>&1; then
  add_pyenv_root "$(pyenv root 2>/dev/null)"
fi
add_pyenv_root "${PYENV_ROOT:-${HOME:-/nonexistent}/.pyenv}"

candidates+=(/usr/bin/python3.12 /usr/local/bin/python3.12
             /usr/bin/python3.13 /usr/local/bin/python3.13)

for c in "${candidates[@]}"; do
  if [ -x "$c" ] && works "$c"; then
    echo "$c"
    exit 0
  fi
done

{
  echo "numpyro-fed needs Python >= 3.12; install it (e.g. pyenv install 3.12) or set PYTHON=/path/to/python3.12"
  echo "(jax >= 0.11 and ArviZ 1.x require Python >= 3.12; none of these worked:"
  echo "  ${PYTHON:+\$PYTHON=$PYTHON, }python3.12/python3.13 on PATH, pyenv versions, /usr/bin/python3.12)"
} >&2
exit 1
