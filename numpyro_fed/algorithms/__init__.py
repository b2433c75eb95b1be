# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Federated inference algorithms as pure factories, one module each, every one
returning a :class:`~numpyro_fed.protocol.FederatedAlgorithm`: ``sfvi``,
``sfvi_avg``, ``pvi``, ``fedgvi``, ``fsgld`` / ``dsgld`` (in ``sgld``) and
``vertical_sfvi``. Their states and messages live in their modules; the factories
are re-exported once, by the package face (``numpyro_fed.sfvi`` and so on)."""
