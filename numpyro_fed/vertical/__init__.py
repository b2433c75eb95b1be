# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Vertically split data (seed 003): marks, the augmented models, the families."""

from numpyro_fed.vertical.augment import AugmentedModel, VerticalModelError, augment
from numpyro_fed.vertical.data import VerticalData
from numpyro_fed.vertical.families import VerticalFamily
from numpyro_fed.vertical.markers import contribution, vertical
from numpyro_fed.vertical.structure import (
    VerticalStructure,
    likelihood_dependencies,
    vertical_structure,
)

__all__ = [
    "AugmentedModel",
    "VerticalData",
    "VerticalFamily",
    "VerticalModelError",
    "VerticalStructure",
    "augment",
    "contribution",
    "likelihood_dependencies",
    "vertical",
    "vertical_structure",
]
