# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""numpyro-fed: federated Bayesian inference for ordinary NumPyro models.

Mark the plate that runs over silos (:func:`federate` or :class:`silo_plate`), split
the data with :class:`FederatedData`, and run a federated algorithm such as
:class:`SFVI` with the API of NumPyro's ``SVI``. Everything else (states, messages,
splitters, densities, baselines) is reachable in its module: ``numpyro_fed.data``,
``numpyro_fed.densities``, ``numpyro_fed.baselines``, ``numpyro_fed.partition``, ...
"""

# Modules whose names stay in them, imported so that ``nf.data.split_iid`` works.
from numpyro_fed import (  # noqa: F401
    baselines,
    data,
    densities,
    expfam,
    partition,
    sgld_diagnostics,
)
from numpyro_fed.algorithms.fedgvi import fedgvi
from numpyro_fed.algorithms.pvi import pvi
from numpyro_fed.algorithms.sfvi import sfvi
from numpyro_fed.algorithms.sfvi_avg import sfvi_avg
from numpyro_fed.algorithms.sgld import dsgld, fsgld
from numpyro_fed.algorithms.vertical_sfvi import vertical_sfvi
from numpyro_fed.audit import audit
from numpyro_fed.data import FederatedData
from numpyro_fed.diagnostics import compare, format_compare, to_arviz
from numpyro_fed.families import AutoAmortized, AutoGlobalLocalNormal, AutoMeanField
from numpyro_fed.handlers import federate, silo_plate
from numpyro_fed.infer.driver import FederatedState, RunResult
from numpyro_fed.infer.fedgvi import FedGVI
from numpyro_fed.infer.mcmc import DSGLD, FSGLD
from numpyro_fed.infer.pvi import PVI, InvalidCavity
from numpyro_fed.infer.vertical import VerticalSFVI
from numpyro_fed.infer.vi import SFVI, SFVIAvg

# nf.SiloData still works; it is listed in numpyro_fed.protocol's __all__.
from numpyro_fed.protocol import FederatedAlgorithm, SiloData  # noqa: F401
from numpyro_fed.surrogates import fit_surrogates
from numpyro_fed.vertical import (
    VerticalData,
    VerticalFamily,
    VerticalModelError,
    augment,
    contribution,
    vertical,
)

__version__ = "0.1.0.dev0"

__all__ = [
    # marking an ordinary model
    "federate",
    "silo_plate",
    "vertical",
    "contribution",
    "augment",
    # data
    "FederatedData",
    "VerticalData",
    # variational families
    "AutoGlobalLocalNormal",
    "AutoMeanField",
    "AutoAmortized",
    "VerticalFamily",
    # the contract and the algorithms as pure factories
    "FederatedAlgorithm",
    "sfvi",
    "sfvi_avg",
    "pvi",
    "fedgvi",
    "fsgld",
    "dsgld",
    "vertical_sfvi",
    # what users instantiate, and what they return
    "SFVI",
    "SFVIAvg",
    "PVI",
    "FedGVI",
    "VerticalSFVI",
    "FSGLD",
    "DSGLD",
    "FederatedState",
    "RunResult",
    "fit_surrogates",
    # checking results, and what crosses the wire
    "audit",
    "to_arviz",
    "compare",
    "format_compare",
    # errors
    "InvalidCavity",
    "VerticalModelError",
]


def __getattr__(name: str):
    # The guide was called AutoStructured until 0.1; Pyro's AutoStructured is a
    # different family (user-chosen per-site dependencies), hence the new name.
    if name == "AutoStructured":
        import warnings

        warnings.warn(
            "nf.AutoStructured is now nf.AutoGlobalLocalNormal (Pyro's AutoStructured is "
            "a different family); the old name will be removed.",
            FutureWarning,
            stacklevel=2,
        )
        return AutoGlobalLocalNormal
    raise AttributeError(f"module 'numpyro_fed' has no attribute {name!r}")
