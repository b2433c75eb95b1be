# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Sphinx configuration: NumPyro's stack (Sphinx, MyST, myst-nb, furo, copybutton).

``make docs`` builds with ``-W``; the tutorials in ``docs/tutorials/`` are MyST notebooks
executed at build time on the CPU. Intersphinx needs the network, so it is opt-in:
``DOCS_INTERSPHINX=1 make docs``.
"""

import importlib.metadata
import os
from pathlib import Path
import sys

ROOT = Path(__file__).resolve().parents[1]
# Document (and execute the tutorials against) this checkout, also when the installed
# package is an editable install of another one; the notebook kernels inherit the
# environment.
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# tqdm.auto in a kernel without ipywidgets warns "IProgress not found" on every page;
# the pages pass progress_bar=False where it matters, so bars are off in the build.
os.environ.setdefault("TQDM_DISABLE", "1")

project = "numpyro-fed"
author = "numpyro-fed developers"
copyright = "Contributors to the numpyro-fed project"
release = importlib.metadata.version("numpyro-fed")
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
    "sphinx_copybutton",
]
if os.environ.get("DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "jax": ("https://docs.jax.dev/en/latest", None),
        "numpyro": ("https://num.pyro.ai/en/stable", None),
        "optax": ("https://optax.readthedocs.io/en/latest", None),
        "arviz": ("https://python.arviz.org/en/stable", None),
    }

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "jupyter_execute"]
root_doc = "index"

# MyST: $...$ maths, ::: fences, and anchors for the headings the pages link to.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# myst-nb: execute every notebook page at build time. "cache" executes everything on
# a fresh clone (the cache lives in docs/_build) and re-runs only changed pages after.
nb_execution_mode = "cache"
nb_execution_cache_path = str(ROOT / "docs" / "_build" / ".jupyter_cache")
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# autodoc: NumPyro-style reST docstrings (":param x:"), members in source order,
# signatures without the type hints (they are in the docstrings).
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True}


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    # The class docstring lists a NamedTuple's fields ("- **field** - meaning");
    # the generated "Alias for field number k" entries would repeat them, emptier.
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)


html_theme = "furo"
html_title = f"numpyro-fed {release}"
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
