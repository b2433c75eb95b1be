# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Published reference posteriors of models that federate along their group plate.

Each entry is an ordinary NumPyro model (:mod:`numpyro_fed.reference.models`), its
data split with the groups as silos, and the posterior means and sds of its global
sites as published by people outside this project:

============================================== ====== ======================= ========
name                                           silos  units per silo          source
============================================== ====== ======================= ========
``eight_schools``                              8      1 school                gym
``eight_schools_noncentered``                  8      1 school                pdb
``radon_contextual_effects_minnesota``         85     1 county (1-116 homes)  gym
``radon_contextual_effects_minnesota_halfnormal`` 85  1 county (1-116 homes)  gym
``synthetic_item_response_theory``             20     20 students             gym
``german_credit_numeric_logistic_regression``  5      200 rows                gym
============================================== ====== ======================= ========

**Provenance** (``data/summaries.json`` names each file; ``scripts/vendor_reference.py``
rebuilds ``data/`` from the sources):

- *gym*: ``inference-gym`` 0.0.5 from PyPI, ground-truth modules
  ``inference_gym/targets/ground_truth/<name>.py`` (Stan, 20,000-50,000 draws; the
  files give mean, sd and the mean's standard error).
- *pdb*: stan-dev/posteriordb, reference draws
  ``posterior_database/reference_posteriors/draws/draws/eight_schools-eight_schools_noncentered.json.zip``
  (10 x 1,000 draws, ESS ~ 10^4); mean and sd computed from the draws.
- Eight schools: Rubin's estimates ``y = [28, 8, -3, 7, -1, 1, 18, 12]``,
  ``sigma = [15, 10, 16, 11, 9, 11, 10, 18]`` (both sources).
- Radon (Gelman & Hill 2007, Minnesota, 919 homes, 85 counties): the raw activity,
  floor and county uranium, recovered from posteriordb's ``radon_mn`` data
  (commit 329ededa), which stores ``log(x + 0.1)`` of both activity and uranium;
  checked equal, home for home, to R's ``HLMdiag::radon`` (``log(x)``). The gym
  (its loader ``inference_gym/internal/data.py::radon``, via TFDS ``radon``) uses
  ``log(activity)`` with activity 0 replaced by 0.1, ``log(Uppm)``, and the county's
  mean floor as the contextual effect: :func:`load` applies exactly that.
- German credit: UCI ``german.data-numeric`` (1,000 rows, 24 integer features, label
  1 = good / 2 = bad), two public copies checked identical. The gym's label is
  ``column 25 - 1`` (TFDS ``label = 2 - x``, then the gym's ``1 - label``), the
  features standardized by their mean and sd (``ddof=0``) over all 1,000 rows.
- Item-response theory: the gym's own synthetic data (400 students x 100 questions,
  30,012 answers; ``inference_gym/internal/datasets/synthetic_item_response_theory.py``).
"""

from collections.abc import Callable
from functools import partial
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from numpyro_fed.data import FederatedData
from numpyro_fed.handlers import federate
from numpyro_fed.reference import models

__all__ = ["Reference", "ReferencePosterior", "load", "names", "score"]

_DATA = Path(__file__).parent / "data"
_SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
_SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


class Reference(NamedTuple):
    """A global site's published posterior summary.

    - **mean** - posterior mean, shaped like the site.
    - **sd** - posterior standard deviation.
    - **mcse** - Monte Carlo standard error of the published mean.
    """

    mean: np.ndarray
    sd: np.ndarray
    mcse: np.ndarray


class ReferencePosterior(NamedTuple):
    """One posterior of the suite.

    - **name** - its name in :func:`names`.
    - **model** - the ordinary NumPyro model (data as keyword arguments).
    - **fed_model** - the model with its group plate marked as the silo plate.
    - **silos** - the name of that plate.
    - **data** - :class:`~numpyro_fed.FederatedData`, groups as silos;
      ``data.pooled()`` is the model's whole data set.
    - **reference** - dict global site -> :class:`Reference`.
    - **source** - where the reference comes from.
    """

    name: str
    model: Callable
    fed_model: Callable
    silos: str
    data: FederatedData
    reference: dict
    source: str


def _radon_minnesota() -> tuple[list, dict]:
    raw = json.loads((_DATA / "radon_mn.json").read_text())
    county = np.asarray(raw["county"])
    floor = np.asarray(raw["floor"], dtype=np.float64)
    activity = np.asarray(raw["activity"], dtype=np.float64)
    log_radon = np.log(np.where(activity <= 0.0, 0.1, activity))
    log_uranium = np.log(np.asarray(raw["uppm"], dtype=np.float64))
    silos = []
    for j in range(len(log_uranium)):
        homes = county == j
        silos.append(
            {
                "log_uranium": log_uranium[j : j + 1],
                "floor_by_county": floor[homes].mean(keepdims=True),
                "floor": floor[homes][None],
                "home": np.ones((1, homes.sum()), bool),
                "log_radon": log_radon[homes][None],
            }
        )
    return silos, raw


def _german_credit() -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(_DATA / "german_credit_numeric.txt", dtype=np.int64)
    features = table[:, :-1].astype(np.float64)
    features = (features - features.mean(0)) / features.std(0)
    return features, (table[:, -1] - 1).astype(np.float64)


def _irt() -> tuple[np.ndarray, np.ndarray]:
    rows = (_DATA / "synthetic_irt.txt").read_text().split()
    grid = np.array([list(r) for r in rows])
    answered = grid != "."
    return answered, np.where(answered, grid, "0").astype(np.float64)


def _data(name: str, num_silos: int | None) -> tuple[Callable, str, FederatedData]:
    if name in ("eight_schools", "eight_schools_noncentered"):
        model = getattr(models, name)
        groups = np.arange(8) % (num_silos or 8)
        data = FederatedData.from_groups(groups, sigma=_SCHOOLS_SIGMA, y=_SCHOOLS_Y)
        return model, "school", data
    if name.startswith("radon_contextual_effects_minnesota"):
        prior = "halfnormal" if name.endswith("halfnormal") else "uniform"
        model = partial(models.radon_contextual_effects, scale_prior=prior)
        silos, _ = _radon_minnesota()
        if num_silos is not None and num_silos != len(silos):
            raise ValueError(f"{name} has one county per silo (85), not {num_silos}.")
        return model, "county", FederatedData.from_silos(silos)
    if name == "synthetic_item_response_theory":
        answered, correct = _irt()
        groups = np.arange(len(answered)) % (num_silos or 20)
        data = FederatedData.from_groups(groups, answered=answered, correct=correct)
        return models.item_response_theory, "student", data
    if name == "german_credit_numeric_logistic_regression":
        features, labels = _german_credit()
        groups = np.arange(len(labels)) % (num_silos or 5)
        data = FederatedData.from_groups(groups, features=features, labels=labels)
        return models.logistic_regression, "row", data
    raise ValueError(f"Unknown reference posterior {name!r}; known: {names()}.")


def names() -> tuple[str, ...]:
    """The suite's posteriors, in the order of the table above."""
    return tuple(json.loads((_DATA / "summaries.json").read_text()))


def load(name: str, num_silos: int | None = None) -> ReferencePosterior:
    """
    Load a reference posterior: model, federated data and published summaries.

    :param str name: one of :func:`names`.
    :param int num_silos: silos for the posteriors whose units are spread over silos
        round-robin (eight schools, item-response theory, German credit; defaults in
        the module table); radon always has one county per silo.
    :rtype: ReferencePosterior

    **Example:**

    .. doctest::

        >>> from numpyro_fed import reference
        >>> post = reference.load("eight_schools")
        >>> post.data.num_silos, sorted(post.reference)
        (8, ['avg_effect', 'log_stddev'])
        >>> round(float(post.reference["avg_effect"].mean), 2)
        5.76
    """
    summaries = json.loads((_DATA / "summaries.json").read_text())
    if name not in summaries:
        raise ValueError(f"Unknown reference posterior {name!r}; known: {names()}.")
    model, silos, data = _data(name, num_silos)
    entry = summaries[name]
    reference = {
        site: Reference(*(np.asarray(v[k]) for k in ("mean", "sd", "mcse")))
        for site, v in entry["globals"].items()
    }
    fed = federate(model, silos=silos)
    return ReferencePosterior(name, model, fed, silos, data, reference, entry["source"])


def score(samples: dict, reference: dict) -> dict:
    """
    Compare posterior draws of the global sites with their reference.

    :param dict samples: site -> draws with a leading sample axis (chains merged).
    :param dict reference: site -> :class:`Reference`, as in
        :attr:`ReferencePosterior.reference`.
    :return: site -> dict with ``mean_error`` (the largest ``|mean - ref| / ref_sd``
        over the site's coordinates) and ``sd_ratio`` (``(min, max)`` of
        ``sd / ref_sd``), and under ``"all"`` the same over every site.

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> from numpyro_fed.reference import Reference, score
        >>> ref = {"x": Reference(np.array(0.0), np.array(1.0), np.array(0.01))}
        >>> s = score({"x": np.array([-1.0, 1.0, -1.0, 1.0])}, ref)
        >>> s["x"]["mean_error"], s["all"]["sd_ratio"]
        (0.0, (1.0, 1.0))
    """
    out: dict[str, Any] = {}
    for site, ref in reference.items():
        if site not in samples:
            raise ValueError(f"No draws of the global site {site!r} to score.")
        x = np.asarray(samples[site], dtype=np.float64)
        if x.shape[1:] != ref.mean.shape:
            raise ValueError(
                f"Draws of {site!r} have shape {x.shape[1:]} per draw; the reference "
                f"has {ref.mean.shape}."
            )
        error = np.abs(x.mean(0) - ref.mean) / ref.sd
        ratio = x.std(0) / ref.sd
        out[site] = {
            "mean_error": float(np.max(error)),
            "sd_ratio": (float(np.min(ratio)), float(np.max(ratio))),
        }
    out["all"] = {
        "mean_error": max(v["mean_error"] for v in out.values()),
        "sd_ratio": (
            min(v["sd_ratio"][0] for v in out.values()),
            max(v["sd_ratio"][1] for v in out.values()),
        ),
    }
    return out
