# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Doctest collection over the package: the Flower runtime needs the optional
``flower`` extra, so its module is collected only where Flower is installed."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("flwr") is None:
    collect_ignore.append("numpyro_fed/runtime/flower.py")
