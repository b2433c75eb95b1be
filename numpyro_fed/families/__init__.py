# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Variational families with an explicit global / local parameter split."""

from numpyro_fed.families.amortized import AutoAmortized
from numpyro_fed.families.structured import AutoGlobalLocalNormal, AutoMeanField

__all__ = ["AutoAmortized", "AutoMeanField", "AutoGlobalLocalNormal"]
