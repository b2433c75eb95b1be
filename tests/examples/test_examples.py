# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Every script in examples/ runs with ``--quick`` as a user runs it (a subprocess from
the repository root, CPU, offline), exits 0, prints its summary with finite numbers,
writes its figures where it is told, and leaves the checkout as it found it.

``make test-examples`` runs these (marker ``examples``; about 4 minutes on 2 cores).
The one test without the marker, in the default run, fails when a script in
examples/ has no smoke test here."""

import math
import os
from pathlib import Path
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


class Smoke(NamedTuple):
    """- **args** - arguments after ``--quick``; ``{out}`` is the output directory.
    - **lines** - regular expressions, each matching at least one line of stdout;
      every number on a matched line must be finite, and there must be one.
    - **files** - files the script must write in ``{out}``."""

    args: tuple = ()
    lines: tuple = ()
    files: tuple = ()


SMOKE = {
    "bnn_label_skew.py": Smoke(
        lines=(
            r"^J = 10, partition 0: SFVI [\d.]+%",
            r"^\s+SFVI\s+[\d.]+\s+[\d.]+\s+[\d.]+",
            r"^\s+independent\s+[\d.]+\s+[\d.]+\s+[\d.]+",
        )
    ),
    "eb_multinomial.py": Smoke(
        lines=(
            r"^\s+SFVI \(100 rounds\)\s+[\d.]+\s+[\d.]+$",
            r"^\s+SFVI-Avg\(2\) x 50\s+[\d.]+\s+[\d.]+$",
            r"^\s+independent \(mean over silos\)\s+[\d.]+\s+[\d.]+$",
        )
    ),
    "fedgvi_robust.py": Smoke(
        lines=(
            r"^PVI \(nll, KL\)\s+-[\d.]+\s+[\d.]+$",
            r"^Fed-GVI \(GCE 0.5, KL\)\s+-[\d.]+\s+[\d.]+$",
            r"^Fed-GVI \(beta 0.5, KL\)\s+-[\d.]+\s+[\d.]+$",
        )
    ),
    "fsgld_noniid.py": Smoke(
        args=("--output-dir", "{out}"),
        lines=(
            r"^ non-IID FSGLD: test -[\d.]+ \+- ",
            r"^ non-IID DSGLD: test -[\d.]+ \+- ",
            r"^beta\[0\]\s+-?[\d.]+",
            r"^\s+tau=10\s+FSGLD: mean [\d.]+ sd",
        ),
        files=("fsgld_trace.png",),
    ),
    "prodlda.py": Smoke(
        lines=(
            r"^SFVI: \d+ s, ELBO trace \[",
            r"^\s+SFVI\s+-?[\d.]+\s+-?[\d.]+",
            r"^\s+independent \(3 silos\)\s+-?[\d.]+",
        )
    ),
    "pvi_bnn.py": Smoke(
        lines=(
            r"^\s*PVI-sync\s+[\d.]+\s+[\d.]+$",
            r"^\s*global VI\s+[\d.]+\s+[\d.]+$",
            r"^\s*local VI\s+[\d.]+\s+[\d.]+$",
        )
    ),
    "pvi_logistic.py": Smoke(
        args=("--output-dir", "{out}"),
        lines=(
            r"^\s+pooled\s+NUTS\s+[\d.]+\s+-[\d.]+$",
            r"^\s+IID\s+PVI-sync\s+[\d.]+",
            r"^label-skew\s+global VI\s+[\d.]+",
        ),
        files=("pvi_logistic.png",),
    ),
    "quickstart.py": Smoke(
        args=("--plot", "{out}/forest.png"),
        lines=(
            r"^SFVI: 300 rounds in [\d.]+s, final loss [\d.]+$",
            r"^beta\[0\](\s+-?[\d.]+){7}$",
            r"^omega(\s+-?[\d.]+){7}$",
        ),
        files=("forest.png",),
    ),
    "six_cities_methods.py": Smoke(
        lines=(
            r"^SFVI\s+beta\[0\](\s+-?[\d.]+){5}$",
            r"^SFVI-Avg\(100\)x2\s+beta\[0\](\s+-?[\d.]+){5}$",
            r"^silo 1 alone\s+beta\[0\](\s+-?[\d.]+){5}$",
        )
    ),
    "vertical_fl.py": Smoke(
        lines=(
            r"max \|E_q\[beta\] - exact mean\|\s+= [\d.]+$",
            r"max rel. error of Var_q\(beta_j\)\s+= [\d.]+$",
        )
    ),
    "vertical_logistic.py": Smoke(
        args=("--output-dir", "{out}"),
        lines=(
            r"^Mean-field VI on the original model: ELBO -[\d.]+$",
            r"^\s+J= 2 rho=1.0 augmented meanfield ELBO\s+-[\d.]+",
            r"^\| 2 \| 1.0 \| [\d.]+ \| power \| meanfield \| -[\d.]+ \|",
        ),
        files=("vertical_logistic_elbo.png", "vertical_logistic_marginals.png"),
    ),
    "vertical_poisson_multilevel.py": Smoke(
        args=("--output-dir", "{out}"),
        lines=(
            r"^\| mu_1\[0\] \| [\d.]+ \|",
            r"^\| meanfield, rho=1 \| original \|",
            r"^\| amortized, rho=1 \| augmented \|",
        ),
        files=("vertical_poisson_multilevel.png",),
    ),
    "vertical_split_nn.py": Smoke(
        lines=(
            r"^fold 2/2: Split NN [\d.]+%",
            r"^\| Split NN \| [\d.]+% ± [\d.]+ \| -[\d.]+ ± [\d.]+ \|",
            r"^\| Hier. Bayes split NN, rho=1 \| [\d.]+% ± [\d.]+ \|",
        )
    ),
    "warm_start.py": Smoke(
        lines=(r"^seed 0: ELBO first -[\d.]+, after SFVI-Avg -[\d.]+, final",),
    ),
}
# Scripts whose smoke test lives elsewhere (they start servers).
ELSEWHERE = {"flower/run_loopback.py": "tests/runtime/test_flower_loopback.py"}
# Modules of the Flower app that run_loopback.py starts, not scripts of their own.
PARTS = {
    "flower/fedapp.py",
    "flower/app_tasks.py",
    "flower/clientapp_worker.py",
    "flower/fast_supernode.py",
    "flower/inprocess.py",
    "flower/quick_pulls.py",
}

# Numbers on a summary line: a "nan" or "inf" there is a failed fit.
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:nan|inf|\d+(?:\.\d*)?(?:e[-+]?\d+)?)(?![\w])")

# Loaded first by every example's interpreter (a sitecustomize on PYTHONPATH):
# connections beyond this machine fail, so an example that downloads fails here.
OFFLINE = """
import socket

def _local(host):
    if isinstance(host, bytes):
        host = host.decode()
    return host in ("localhost", "::1") or str(host).startswith("127.")

def _refuse(host):
    raise OSError(f"an example tried to reach {host!r}; examples must run offline")

_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo

def connect(self, address):
    if isinstance(address, tuple) and not _local(address[0]):
        _refuse(address[0])
    return _connect(self, address)

def connect_ex(self, address):
    if isinstance(address, tuple) and not _local(address[0]):
        _refuse(address[0])
    return _connect_ex(self, address)

def getaddrinfo(host, *args, **kwargs):
    if host is not None and not _local(host):
        _refuse(host)
    return _getaddrinfo(host, *args, **kwargs)

socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
socket.getaddrinfo = getaddrinfo
"""


def scripts():
    """Every ``.py`` file under examples/, relative to it."""
    return sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.py"))


def test_every_example_has_a_smoke_test():
    found = set(scripts())
    tested = set(SMOKE) | set(ELSEWHERE) | PARTS
    assert found - tested == set(), "examples without a smoke test in SMOKE"
    assert tested - found == set(), "smoke tests of examples that do not exist"
    for path in ELSEWHERE.values():
        assert (ROOT / path).is_file(), path


@pytest.fixture(scope="session")
def offline_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("offline")
    (path / "sitecustomize.py").write_text(OFFLINE)
    return path


def environment(offline_dir):
    env = dict(os.environ)
    # The example chooses its own precision, as when a user runs it.
    env.pop("JAX_ENABLE_X64", None)
    env.update(
        JAX_PLATFORMS="cpu",
        MPLBACKEND="Agg",
        PYTHONDONTWRITEBYTECODE="1",  # no __pycache__ in examples/
        # this checkout's package, whatever the environment has installed
        PYTHONPATH=os.pathsep.join([str(offline_dir), str(ROOT)]),
    )
    return env


def snapshot():
    """Every file under examples/ with its modification time."""
    return {p: p.stat().st_mtime_ns for p in EXAMPLES.rglob("*") if p.is_file()}


@pytest.mark.examples
def test_offline_guard(offline_dir):
    code = "import urllib.request; urllib.request.urlopen('http://example.com')"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=environment(offline_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "examples must run offline" in done.stderr


@pytest.mark.examples
@pytest.mark.parametrize(
    "name", [s for s in scripts() if s not in set(ELSEWHERE) | PARTS]
)
def test_example_quick(name, tmp_path, offline_dir):
    assert name in SMOKE, f"examples/{name} has no smoke settings in SMOKE"
    smoke = SMOKE[name]
    out = tmp_path / "out"
    args = [a.format(out=out) for a in smoke.args]
    before = snapshot()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--quick", *args],
        cwd=ROOT,
        env=environment(offline_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, log
    for pattern in smoke.lines:
        lines = [s for s in done.stdout.splitlines() if re.search(pattern, s)]
        assert lines, f"no line matches {pattern!r}\n{log}"
        for line in lines:
            numbers = [float(x) for x in NUMBER.findall(line)]
            assert numbers and all(map(math.isfinite, numbers)), f"{line!r}\n{log}"
    for file in smoke.files:
        assert (out / file).stat().st_size > 0, file
    assert snapshot() == before, "the example wrote under examples/"
