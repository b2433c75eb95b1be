#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter, or explain how to get one.
# Order: $PYTHON; python3.12/python3.13 on PATH (only if they actually run, since a
# pyenv shim may exist but fail); pyenv's installed versions; /usr/bin/python3.1x.
set -u
works() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
for name in python3.12 python3.13 python3; do
  command -v "$name" >/dev/null 2>&1 && candidates+=("$(command -v "$name")")
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root 2>/dev/null)
  # 3.12 first: the version the project is tested on.
  for dir in $(ls -d "$root"/versions/3.12* 2>/dev/null | sort -rV) \
             $(ls -d "$root"/versions/3.1[3-9]* 2>/dev/null | sort -rV); do
    candidates+=("$dir/bin/python")
  done
fi
for dir in $(ls -d "$HOME"/.pyenv/versions/3.12* 2>/dev/null | sort -rV); do
  candidates+=("$dir/bin/python")
done
candidates+=(/usr/bin/python3.13 /usr/bin/python3.12 /usr/local/bin/python3.13 /usr/local/bin/python3.12)
for c in "${candidates[@]}"; do
  if [ -x "$c" ] || command -v "$c" >/dev/null 2>&1; then
    if works "$c"; then echo "$c"; exit 0; fi
  fi
done
echo "numpyro-fed needs Python >= 3.12 (jax >= 0.11 and ArviZ 1.x require it) and none was found." >&2
echo "Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
exit 1
