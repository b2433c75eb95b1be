# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""numpyro-fed: federated Bayesian inference for ordinary NumPyro models.

Mark the plate that runs over silos (:func:`federate` or :class:`silo_plate`), split
the data with :class:`FederatedData`, and run a federated algorithm such as
:class:`SFVI` with the API of NumPyro's ``SVI``.
"""

from numpyro_fed import expfam, sgld_diagnostics
from numpyro_fed.algorithms import (
    PVI,
    FedGVI,
    InvalidCavity,
    PVIParams,
    PVIResult,
    PVIState,
    RowIndexMismatchError,
    VerticalParams,
    VerticalSFVI,
    VerticalSFVIState,
    annealed_step_size,
    sfvi,
    sfvi_avg,
)
from numpyro_fed.baselines import fit_centralized, fit_independent
from numpyro_fed.data import (
    FederatedData,
    split_dirichlet,
    split_iid,
    split_label_skew,
)
from numpyro_fed.densities import server_log_density, silo_log_density
from numpyro_fed.diagnostics import compare, format_compare, to_arviz
from numpyro_fed.families import AutoAmortized, AutoMeanField, AutoStructured
from numpyro_fed.handlers import federate, silo_plate
from numpyro_fed.infer.driver import FederatedState, RunResult
from numpyro_fed.infer.mcmc import DSGLD, FSGLD, SGLDState
from numpyro_fed.infer.vi import SFVI, SFVIAvg, SFVIParams
from numpyro_fed.partition import ModelRoles, analyze
from numpyro_fed.protocol import FederatedAlgorithm, SiloData
from numpyro_fed.surrogates import fit_surrogates
from numpyro_fed.vertical import (
    AugmentedModel,
    VerticalData,
    VerticalFamily,
    VerticalModelError,
    augment,
    contribution,
    likelihood_dependencies,
    vertical,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "FedGVI",
    "InvalidCavity",
    "PVI",
    "PVIParams",
    "PVIResult",
    "PVIState",
    "AutoAmortized",
    "AutoMeanField",
    "AutoStructured",
    "DSGLD",
    "FSGLD",
    "FederatedAlgorithm",
    "FederatedData",
    "ModelRoles",
    "RunResult",
    "SFVI",
    "SFVIAvg",
    "SFVIParams",
    "FederatedState",
    "SGLDState",
    "SiloData",
    "analyze",
    "annealed_step_size",
    "expfam",
    "compare",
    "federate",
    "fit_centralized",
    "fit_independent",
    "fit_surrogates",
    "format_compare",
    "server_log_density",
    "sfvi",
    "sfvi_avg",
    "sgld_diagnostics",
    "silo_log_density",
    "silo_plate",
    "split_dirichlet",
    "split_iid",
    "split_label_skew",
    "to_arviz",
    "AugmentedModel",
    "RowIndexMismatchError",
    "VerticalData",
    "VerticalFamily",
    "VerticalModelError",
    "VerticalParams",
    "VerticalSFVI",
    "VerticalSFVIState",
    "augment",
    "contribution",
    "likelihood_dependencies",
    "vertical",
]
