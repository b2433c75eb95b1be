# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""What crosses the wire, leaf by leaf: :func:`audit` reads an algorithm's messages
off its functions' shapes (``jax.eval_shape``, nothing runs) and flags what could
carry a silo's units.

A leaf is flagged when its size grows with a silo's units: a silo's reply is traced
on the data's layout and on one padded with more units, and a leaf whose shape changes
scales with the units. The server's message is computed without any silo's data, so
it can carry units only through the algorithm's own closure (built from the data):
one of its leaves is flagged when an axis has the silos' padded size, which may be a
coincidence (a parameter of that size) that a layout padded further (``pad_to=``)
tells apart. Silos with fewer than ``min_units`` units are listed too: whatever such
a silo replies is a function of that few units' data. See ``docs/privacy.md`` for
what each algorithm's leaves reveal.
"""

from typing import Any, NamedTuple

import jax

from numpyro_fed.protocol import FederatedAlgorithm, SiloData, silo_data_of
from numpyro_fed.runtime.accounting import nbytes

__all__ = ["Audit", "WireLeaf", "audit"]

SERVER_TO_SILO = "server -> silo"
SILO_TO_SERVER = "silo -> server"


class WireLeaf(NamedTuple):
    """One array that crosses the wire in a round.

    - **direction** - ``"server -> silo"`` or ``"silo -> server"``.
    - **part** - ``"broadcast"`` (every contacted silo gets it), ``"routed"`` (one
      silo's own row) or ``"reply"``.
    - **path** - the leaf's tree path in its part (``jax.tree_util.keystr``).
    - **shape** - its shape (for a routed leaf: one silo's row).
    - **dtype** - its dtype's name.
    - **nbytes** - its bytes (a typed PRNG key counts as its key data).
    - **flag** - why the leaf may carry a silo's units, ``""`` if nothing does.
    """

    direction: str
    part: str
    path: str
    shape: tuple
    dtype: str
    nbytes: int
    flag: str


class Audit(NamedTuple):
    """The result of :func:`audit`; ``str(audit)`` is a table.

    - **leaves** - every :class:`WireLeaf` of one round, server to silo first.
    - **sizes** - each silo's number of real units.
    - **padded_size** - ``P``, the units every silo is padded to.
    - **min_units** - the silo size below which a silo is listed in ``small_silos``.
    - **small_silos** - silos with fewer than ``min_units`` units: their replies
      are functions of that few units' data.
    """

    leaves: tuple
    sizes: tuple
    padded_size: int
    min_units: int
    small_silos: tuple

    @property
    def flagged(self) -> tuple:
        """The leaves that may carry a silo's units."""
        return tuple(leaf for leaf in self.leaves if leaf.flag)

    def bytes(self, direction: str) -> int:
        """Bytes one contacted silo exchanges in ``direction`` per round."""
        return sum(leaf.nbytes for leaf in self.leaves if leaf.direction == direction)

    def __str__(self) -> str:
        header = ("direction", "part", "path", "shape", "dtype", "bytes", "flag")
        rows = [
            (
                leaf.direction,
                leaf.part,
                leaf.path or "(the whole part)",
                str(leaf.shape),
                leaf.dtype,
                str(leaf.nbytes),
                leaf.flag,
            )
            for leaf in self.leaves
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"per round and silo: {self.bytes(SERVER_TO_SILO)} bytes down, "
            f"{self.bytes(SILO_TO_SERVER)} bytes up; "
            f"{len(self.flagged)} leaf(s) flagged"
        )
        for j in self.small_silos:
            lines.append(
                f"silo {j} holds {self.sizes[j]} unit(s) (< min_units="
                f"{self.min_units}): its reply is a function of that data alone"
            )
        return "\n".join(lines)


def _shapes(tree: Any) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): x for p, x in leaves}


def _padded(spec: SiloData, units: int) -> SiloData:
    """``spec`` with ``units`` more units along every array's unit axis (axis 0)."""
    grow = lambda x: jax.ShapeDtypeStruct((x.shape[0] + units, *x.shape[1:]), x.dtype)  # noqa: E731
    return jax.tree.map(grow, spec)


def _key_like(key: Any) -> Any:
    if key is None:
        key = jax.random.key(0)
    return jax.eval_shape(lambda: key) if not hasattr(key, "shape") else key


def audit(
    algorithm: Any,
    data: Any,
    *,
    server_key: Any = None,
    silo_key: Any = None,
    min_units: int = 2,
    extra_units: int = 3,
) -> Audit:
    """
    Every leaf that crosses the wire in a round of ``algorithm`` on ``data``'s
    layout, with its shape and bytes, and a flag on any leaf that may carry a
    silo's units (see the module docstring). Only shapes are computed.

    :param algorithm: a :class:`~numpyro_fed.FederatedAlgorithm`, or a user class
        with a ``federation(data)`` method (``SFVI``, ``PVI``, ...), whose keys are
        then shaped as its runs shape them.
    :param FederatedData data: the silos' data (only the layout is used).
    :param server_key: a round's server key, or its ``jax.ShapeDtypeStruct``
        (default: one key; SFVI's factory takes one per particle).
    :param silo_key: a silo's round key, or its ``ShapeDtypeStruct`` (default: one).
    :param int min_units: list the silos with fewer units in ``small_silos``.
    :param int extra_units: units added to the padded size for the comparison.
    :rtype: Audit

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with nf.silo_plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> data = nf.FederatedData.from_groups([0, 0, 1, 2, 2], y=jnp.arange(5.0))
        >>> report = nf.audit(nf.DSGLD(model, 1e-3, tau=4).algorithm(data), data)
        >>> report.flagged, report.small_silos
        ((), (1,))
        >>> [(leaf.path, leaf.shape) for leaf in report.leaves if leaf.part == "reply"]
        [(".trajectory['mu']", (4,))]
    """
    if not isinstance(min_units, int) or min_units < 1:
        raise ValueError(f"min_units must be a positive int, got {min_units!r}.")
    if not isinstance(extra_units, int) or extra_units < 1:
        raise ValueError(f"extra_units must be a positive int, got {extra_units!r}.")
    if not all(hasattr(data, a) for a in ("arrays", "mask", "unit_ids", "sizes")):
        raise TypeError(
            f"audit needs the silos' FederatedData, got {type(data).__name__}."
        )
    if not isinstance(algorithm, FederatedAlgorithm):
        if not callable(getattr(algorithm, "federation", None)):
            raise TypeError(
                "audit needs a FederatedAlgorithm or a class with a federation(data) "
                f"method (SFVI, PVI, ...), got {type(algorithm).__name__}; for FSGLD "
                "and DSGLD pass kernel.algorithm(data)."
            )
        federation = algorithm.federation(data)
        algorithm = federation.algorithm
        if server_key is None:
            server_key = jax.eval_shape(federation.round_keys, jax.random.key(0))[1]
        if silo_key is None:
            silo_key = federation.silo_key_like
    server_key, silo_key = _key_like(server_key), _key_like(silo_key)
    key = jax.eval_shape(lambda: jax.random.key(0))
    stacked = silo_data_of(data)
    spec = jax.eval_shape(lambda: jax.tree.map(lambda x: x[0], stacked))

    server = jax.eval_shape(algorithm.init_server, key)
    message = jax.eval_shape(algorithm.server_message, server, server_key)
    routed = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), message.routed
    )

    def reply_on(silo_spec: SiloData) -> Any:
        state = jax.eval_shape(algorithm.init_silo, key, silo_spec)
        return jax.eval_shape(
            lambda m, s, d, k: algorithm.silo_step(m.at(0), s, d, k)[0],
            message,
            state,
            silo_spec,
            silo_key,
        )

    reply = _shapes(reply_on(spec))
    grown = _shapes(reply_on(_padded(spec, extra_units)))
    padded = data.padded_size

    leaves = []
    for part, tree in (("broadcast", message.broadcast), ("routed", routed)):
        for path, x in _shapes(tree).items():
            flag = ""
            if padded in x.shape:
                flag = (
                    f"axis of the padded size {padded} (or a coincidence: try pad_to=)"
                )
            leaves.append((SERVER_TO_SILO, part, path, x, flag))
    for path, x in reply.items():
        other = grown.get(path)
        flag = ""
        if other is None or other.shape != x.shape:
            after = "absent" if other is None else str(other.shape)
            flag = (
                f"grows with the silo's units ({x.shape} at P={padded}, {after} at "
                f"P={padded + extra_units})"
            )
        leaves.append((SILO_TO_SERVER, "reply", path, x, flag))
    small = tuple(j for j, n in enumerate(data.sizes) if n < min_units)
    return Audit(
        tuple(
            WireLeaf(d, p, path, tuple(x.shape), str(x.dtype), nbytes(x), flag)
            for d, p, path, x, flag in leaves
        ),
        tuple(data.sizes),
        padded,
        min_units,
        small,
    )
