# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Effect handlers that mark federated roles, and nothing else.

A silo holds a subset of the indices of one plate: the *silo plate*. These handlers
only write that plate's name into ``msg["fed"]`` of every sample/param/deterministic
site opened inside it; :mod:`numpyro_fed.partition` turns the marks into roles.
Roles are kept in a key of our own because :class:`numpyro.handlers.replay` replaces
``msg["infer"]`` of latent sites with the guide's.

As with every NumPyro handler, apply them inside the function you jit, never at
module level with shared state: these messengers hold no state, so reuse is safe.
"""

from typing import Any, Callable

import numpyro
from numpyro.primitives import Messenger

__all__ = ["FED_KEY", "federate", "silo_plate", "silo_plate_name"]

#: The message key in which roles are written.
FED_KEY = "fed"

_MARKED_TYPES = ("sample", "param", "deterministic")


def _mark(msg: dict, plate_name: str) -> None:
    msg.setdefault(FED_KEY, {})["silo_plate"] = plate_name


class silo_plate(numpyro.plate):
    """
    Drop-in replacement for :class:`numpyro.plate` whose indices are split across
    silos. Everything sampled or observed inside it belongs to the silo holding the
    index; everything outside is global.

    The plate size must be the number of units in the arrays the model receives
    (e.g. ``X.shape[0]``), because each silo runs the same model on its own arrays.

    :param str name: plate name.
    :param int size: number of units (of the arrays passed to the model).
    :param int subsample_size: optional subsample size, as in :class:`numpyro.plate`.
    :param int dim: optional batch dimension, as in :class:`numpyro.plate`.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
        ...     with nf.silo_plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> nf.partition.analyze(model, nf.FederatedData.from_groups([0, 0, 1], y=jnp.ones(3))).silo_plate
        'data'
    """

    def process_message(self, msg: dict) -> None:
        super().process_message(msg)
        if msg["type"] in _MARKED_TYPES:
            _mark(msg, self.name)


class federate(Messenger):
    """
    Partition an existing plate of an unedited NumPyro model across silos.

    ``federate(model, silos="child")`` behaves exactly like ``model`` (NUTS and
    centralized SVI run on it unchanged) and marks every site inside the plate named
    ``silos`` (nested plates included) as belonging to the silo that holds the index.

    :param callable fn: the NumPyro model.
    :param str silos: name of the plate whose indices are split across silos.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
        ...     with numpyro.plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> fed = nf.federate(model, silos="data")
        >>> fed.silos
        'data'
    """

    def __init__(self, fn: Callable | None = None, silos: str | None = None) -> None:
        if not isinstance(silos, str) or not silos:
            raise ValueError(
                "federate(model, silos=...) needs the name of the plate that runs over "
                f"silos, e.g. silos='child'; got silos={silos!r}."
            )
        self.silos = silos
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        # Outer handlers see the frames of the plates the model opened inside them.
        if msg["type"] in _MARKED_TYPES and any(
            frame.name == self.silos for frame in msg.get("cond_indep_stack", ())
        ):
            _mark(msg, self.silos)


def silo_plate_name(msg: dict[str, Any]) -> str | None:
    """Name of the silo plate a traced site belongs to, or ``None`` for a global site."""
    return msg.get(FED_KEY, {}).get("silo_plate")
