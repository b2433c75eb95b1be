# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The API reference (``docs/api/``) documents every public name: each name of
``numpyro_fed.__all__`` has an autodoc directive, every directive names something that
exists, and each module the reference promises has its ``automodule``. Read from the
page sources, so the check needs no Sphinx build."""

import importlib
from pathlib import Path
import re

import pytest

import numpyro_fed as nf

API = Path(__file__).resolve().parents[1] / "docs" / "api"

# reST ".. autoclass:: name" and MyST "```{autoclass} name"; ".. currentmodule:: mod"
# (or its MyST form) qualifies the short names after it.
DIRECTIVE = re.compile(
    r"^(?:\.\.\s+|```\{)(auto\w+|currentmodule|module)(?:::|\})\s+([\w.]+)", re.M
)
EXCLUDED = re.compile(r"^\s+:exclude-members:\s*(.+)$", re.M)

MODULES = [
    "numpyro_fed",
    "numpyro_fed.data",
    "numpyro_fed.densities",
    "numpyro_fed.aggregate",
    "numpyro_fed.baselines",
    "numpyro_fed.partition",
    "numpyro_fed.expfam",
    "numpyro_fed.protocol",
    "numpyro_fed.diagnostics",
    "numpyro_fed.sgld_diagnostics",
    "numpyro_fed.runtime.simulate",
    "numpyro_fed.runtime.sequential",
    "numpyro_fed.runtime.events",
    "numpyro_fed.runtime.flower",
]


def documented(pages: list[Path]) -> tuple[set[str], set[str], set[str]]:
    """(fully qualified objects, automodule'd modules, excluded module members)."""
    objects, modules, excluded = set(), set(), set()
    for page in pages:
        text = page.read_text()
        current = None
        for match in DIRECTIVE.finditer(text):
            kind, name = match.groups()
            if kind in ("currentmodule", "module"):
                current = name
            elif kind == "automodule":
                modules.add(name)
                current = name
                block = text[match.end() : match.end() + 400].split("\n\n")[0]
                for names in EXCLUDED.findall(block):
                    excluded |= {f"{name}.{n.strip()}" for n in names.split(",")}
            elif current and not name.startswith(current + "."):
                objects.add(f"{current}.{name}")
            else:
                objects.add(name)
    return objects, modules, excluded


def api_pages() -> list[Path]:
    return sorted([*API.glob("*.rst"), *API.glob("*.md")])


def test_every_public_name_is_documented():
    objects, _, _ = documented(api_pages())
    missing = [n for n in nf.__all__ if f"numpyro_fed.{n}" not in objects]
    assert not missing, f"numpyro_fed.__all__ names missing from docs/api/: {missing}"


def test_every_promised_module_has_automodule():
    _, modules, _ = documented(api_pages())
    missing = [m for m in MODULES if m not in modules]
    assert not missing, f"modules without an automodule in docs/api/: {missing}"


def test_excluded_members_are_documented_at_the_top():
    # a module page may leave out a name only because the numpyro_fed page has it
    objects, _, excluded = documented(api_pages())
    for name in excluded:
        short = name.rsplit(".", 1)[1]
        assert f"numpyro_fed.{short}" in objects, (
            f"{name} is excluded and documented nowhere"
        )


def test_every_directive_names_an_existing_object():
    objects, modules, _ = documented(api_pages())
    for module in modules:
        if module == "numpyro_fed.runtime.flower":
            pytest.importorskip("flwr")
        importlib.import_module(module)
    for name in sorted(objects):
        module, attr = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), attr), f"docs/api/ names {name}"


def test_parser_sees_a_missing_name(tmp_path):
    page = tmp_path / "api.rst"
    page.write_text(
        ".. currentmodule:: numpyro_fed\n\n.. autoclass:: SFVI\n\n"
        "```{autofunction} numpyro_fed.audit\n```\n"
    )
    objects, _, _ = documented([page])
    assert objects == {"numpyro_fed.SFVI", "numpyro_fed.audit"}
    assert "numpyro_fed.PVI" not in objects
