# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""What users instantiate: NumPyro-style classes over the algorithm factories, all on
one driver (:mod:`numpyro_fed.infer.driver`)."""
