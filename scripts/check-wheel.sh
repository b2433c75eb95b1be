#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment (its dependencies come
# from the package index) and run the quickstart there, away from the source tree: a
# check that the wheel holds the whole package and that pyproject.toml declares what
# it imports. Needs network access to the index; takes minutes (see `make wheel-check`).
#
# The quickstart is `examples/quickstart.py --quick` (with the `examples` extra) when
# the example has that flag; otherwise the README's usage block, with small synthetic
# data (and a short NUTS run) supplied for the names the block leaves undefined.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
interp=$(bash scripts/find-python.sh)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export JAX_PLATFORMS=cpu PIP_DISABLE_PIP_VERSION_CHECK=1

start=$SECONDS
echo "== building the wheel (pip wheel, with the build backend from the index)"
"$interp" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo"
wheel=$(ls "$work"/dist/numpyro_fed-*.whl)
echo "   $(basename "$wheel")"

echo "== installing it into a fresh venv"
"$interp" -m venv "$work/venv"
py=$work/venv/bin/python
if grep -q -- "--quick" examples/quickstart.py; then
  "$py" -m pip install --quiet "$wheel[examples]"
else
  "$py" -m pip install --quiet "$wheel"
fi
echo "   installed in $((SECONDS - start)) s"

# Run from an empty directory so that the source tree cannot be imported instead.
cd "$work"
"$py" - <<'EOF'
import numpyro_fed
where = numpyro_fed.__file__
assert "site-packages" in where, f"numpyro_fed imported from {where}, not the wheel"
print(f"   numpyro_fed {numpyro_fed.__version__} from {where}")
EOF

if grep -q -- "--quick" "$repo/examples/quickstart.py"; then
  echo "== examples/quickstart.py --quick"
  "$py" "$repo/examples/quickstart.py" --quick
else
  echo "== the README's usage block"
  "$py" - "$repo/README.md" <<'EOF'
import ast
import re
import sys

text = open(sys.argv[1]).read()
usage = text.split("## Usage", 1)[1]
block = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
defined = {
    node.id
    for node in ast.walk(ast.parse(block))
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
}
ns: dict = {}
if not {"X", "y", "hospital_of_child"} <= defined:
    # Six hospitals, 120 children seen at 4 visits, 3 covariates.
    exec(
        "import numpy as np\n"
        "rng = np.random.default_rng(0)\n"
        "X = rng.normal(size=(120, 4, 3))\n"
        "y = (rng.random((120, 4)) < 0.4).astype(float)\n"
        "hospital_of_child = rng.integers(0, 6, 120)\n",
        ns,
    )
lines = block.splitlines(keepends=True)
cut = next(
    (i for i, line in enumerate(lines) if "nuts_mcmc" in line),
    len(lines),
)
exec(compile("".join(lines[:cut]), "README usage", "exec"), ns)
if cut < len(lines) and "nuts_mcmc" not in defined:
    from numpyro.infer import MCMC, NUTS
    import jax

    ns["nuts_mcmc"] = MCMC(
        NUTS(ns["model"]), num_warmup=200, num_samples=200, progress_bar=False
    )
    ns["nuts_mcmc"].run(jax.random.key(2), ns["X"], ns["y"])
exec(compile("\n" * cut + "".join(lines[cut:]), "README usage", "exec"), ns)
EOF
fi
echo "== wheel check passed in $((SECONDS - start)) s"
