# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Vertically split data: the same rows, different columns at each party."""

from typing import Any

import jax.numpy as jnp

from numpyro_fed.checks import check_finite_array

__all__ = ["LABELS", "VerticalData"]

#: Where the labels live: with the server only (S2), or shared with every party (S1).
LABELS = ("server", "shared")
_HOLDER = {"server": "the server (the labels)", "public": "the public arrays"}


class VerticalData:
    """
    Arrays held by each party and by the label-holding server, passed to the model
    as keyword arguments (``model(**data.pooled())`` is the pooled model).

    A party's *view* (:meth:`view`) holds its own arrays, the public ones, the
    server's when ``labels="shared"``, and a placeholder of the same shape in place
    of every other array: NaN for floats, so that any computation that reads another
    party's columns poisons its result (the simulation's privacy check). The arrays
    themselves must be finite: a NaN or inf is refused, naming the array and its
    holder.

    :param dict parties: party name -> dict of arrays (rows along axis 0).
    :param dict server: the server's arrays (the labels), name -> array.
    :param dict public: arrays every party may hold (e.g. an offset).
    :param str labels: ``"server"`` (only the server sees ``server`` arrays) or
        ``"shared"`` (every party does; required by the power likelihood).
    :param placeholder: value replacing arrays a party does not hold (``None``:
        every view is the pooled data, for comparisons).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro_fed as nf
        >>> data = nf.VerticalData({"a": {"x1": jnp.ones((3, 2))}, "b": {"x2": jnp.ones(3)}},
        ...                        server={"y": jnp.zeros(3)})
        >>> data.parties, data.num_rows, bool(jnp.isnan(data.view("a")["x2"]).all())
        (('a', 'b'), 3, True)
    """

    def __init__(
        self,
        parties: dict[str, dict[str, Any]],
        server: dict[str, Any] | None = None,
        *,
        public: dict[str, Any] | None = None,
        labels: str = "server",
        placeholder: Any = float("nan"),
    ) -> None:
        if not isinstance(parties, dict) or not parties:
            raise ValueError(
                "parties must be a non-empty dict: party -> {name: array}."
            )
        if labels not in LABELS:
            raise ValueError(f"labels must be 'server' or 'shared', got {labels!r}.")
        self.labels = labels
        self.placeholder = placeholder
        self.owner: dict[str, str] = {}
        self.arrays: dict[str, jnp.ndarray] = {}
        groups = [(p, a) for p, a in sorted(parties.items())]
        groups += [("server", server or {}), ("public", public or {})]
        rows: tuple[str, int] | None = None
        for owner, arrays in groups:
            if owner in ("server", "public") and owner in parties:
                raise ValueError(f"{owner!r} is reserved and cannot name a party.")
            for name, value in arrays.items():
                if name in self.arrays:
                    raise ValueError(
                        f"Array {name!r} is given by both {self.owner[name]!r} and "
                        f"{owner!r}; every array has one holder."
                    )
                value = jnp.asarray(value)
                # A NaN here would surface as NumPyro's "invalid loc parameter", or
                # as a party reading columns it does not hold (the NaN placeholder).
                check_finite_array(name, value, _HOLDER.get(owner, f"party {owner!r}"))
                if owner != "public":
                    if value.ndim == 0:
                        raise ValueError(
                            f"Array {name!r} of {owner!r} is a scalar; vertically split "
                            "arrays have rows along axis 0."
                        )
                    if rows is None:
                        rows = (owner, value.shape[0])
                    elif value.shape[0] != rows[1]:
                        raise ValueError(
                            f"Parties {rows[0]!r} and {owner!r} have different row "
                            f"counts ({rows[1]} and {value.shape[0]}, array {name!r}): "
                            "vertically split data need the same, aligned rows."
                        )
                self.owner[name] = owner
                self.arrays[name] = value
        self.parties = tuple(sorted(parties))
        self.num_rows = rows[1] if rows is not None else 0

    @property
    def num_silos(self) -> int:
        """The number of parties: the silos of a federated round."""
        return len(self.parties)

    def pooled(self) -> dict[str, jnp.ndarray]:
        """Every array (the centralized model's keyword arguments)."""
        return dict(self.arrays)

    def holds(self, holder: str, name: str) -> bool:
        """Whether ``holder`` (a party or ``"server"``) holds array ``name``."""
        owner = self.owner[name]
        if owner in (holder, "public"):
            return True
        return owner == "server" and self.labels == "shared" and holder != "server"

    def view(self, holder: str) -> dict[str, jnp.ndarray]:
        """The arrays as ``holder`` (a party name or ``"server"``) sees them."""
        if holder != "server" and holder not in self.parties:
            raise ValueError(
                f"Unknown holder {holder!r}: parties are {list(self.parties)} (or "
                "'server')."
            )
        if self.placeholder is None:
            return self.pooled()
        return {
            name: value if self.holds(holder, name) else _fill(value, self.placeholder)
            for name, value in self.arrays.items()
        }


def _fill(value: jnp.ndarray, placeholder: Any) -> jnp.ndarray:
    if jnp.issubdtype(value.dtype, jnp.floating):
        return jnp.full_like(value, placeholder)
    return jnp.zeros_like(value)  # integer or boolean arrays cannot hold NaN


def row_hash(idx: Any) -> jnp.ndarray:
    """
    A ``uint32`` hash of a round's ordered row indices, which each party reports with
    its auxiliary so that the server can check that every party used the same rows
    (a polynomial hash: any change of an index, or of the order, changes it except
    for rare collisions; it is a consistency check, not a cryptographic one). Works
    under ``jit``; Python's ``hash`` is salted per process and could not be compared
    across parties.

    :param idx: integer row indices.
    :return: a ``uint32`` scalar.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.vertical.data import row_hash
        >>> bool(row_hash(jnp.array([3, 1, 2])) == row_hash(jnp.array([1, 3, 2])))
        False
    """
    idx = jnp.ravel(jnp.asarray(idx)).astype(jnp.uint32)
    # powers of the FNV prime, wrapping modulo 2**32 like every uint32 product here
    weights = jnp.cumprod(jnp.full(idx.shape, 16777619, jnp.uint32))
    mixed = (idx + jnp.uint32(0x9E3779B9)) * weights
    return jnp.sum(mixed, dtype=jnp.uint32) ^ jnp.uint32(idx.size)
