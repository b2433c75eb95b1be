# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Marks for vertically split data: which sites and which per-row contribution
belong to which party (same rows, different columns).

``with vertical("bank"):`` tags every site opened in its block with the party, in
``msg["fed"]["party"]`` (like :class:`~numpyro_fed.silo_plate`, and for the same reason:
``replay`` replaces ``msg["infer"]``). ``contribution("bank", value)`` marks that
party's per-row contribution :math:`g_j(x_j, \\theta_j)` to the shared predictor.

Without an inference handler the model is unchanged: ``contribution`` returns
``value`` and emits no site, so NUTS on the marked model is NUTS on the original model.
Under :func:`~numpyro_fed.augment` the contribution asks the stack, like
``numpyro.prng_key()`` does, what to return (an auxiliary draw :math:`z_j`, the exact
:math:`g_j`, ...); the handler that answers lives in :mod:`numpyro_fed.vertical.augment`.
"""

from typing import Any, Callable

from numpyro.primitives import _PYRO_STACK, Messenger, apply_stack

from numpyro_fed.handlers import FED_KEY

__all__ = ["PARTY_KEY", "contribution", "party_of", "vertical"]

#: Key of ``msg["fed"]`` that holds a site's party.
PARTY_KEY = "party"

_MARKED_TYPES = ("sample", "param", "deterministic")
#: Custom message types, answered by the augmentation handler and ignored by others.
BLOCK_MSG = "vfl_block"
CONTRIBUTION_MSG = "vfl_contribution"


def _check_party(party: Any, where: str) -> str:
    if not isinstance(party, str) or not party or "/" in party:
        raise ValueError(
            f"{where}: the party must be a non-empty string without '/', got {party!r}."
        )
    return party


def active_party() -> str | None:
    """The party of the innermost open :class:`vertical` block, or ``None``."""
    for handler in reversed(_PYRO_STACK):
        if isinstance(handler, vertical):
            return handler.party
    return None


class vertical(Messenger):
    """
    Mark a block of a model whose features and coefficients belong to one party.

    Every ``sample``, ``param`` and ``deterministic`` site opened inside the block is
    tagged with ``party``; the block must mark its per-row contribution with
    :func:`contribution`. Blocks of different parties must not nest (that would make
    a site belong to two parties). Usable as a context manager or to wrap a function,
    ``vertical("bank")(fn)``.

    :param str party: the party's name (no ``/``; it prefixes derived sites).
    :param callable fn: optional function to wrap.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro import handlers
        >>> import numpyro_fed as nf
        >>> def model(x, y=None):
        ...     with nf.vertical("bank"):
        ...         beta = numpyro.sample("beta", dist.Normal(0, 1).expand([2]).to_event(1))
        ...         eta = nf.contribution("bank", x @ beta)
        ...     with numpyro.plate("rows", x.shape[0]):
        ...         numpyro.sample("y", dist.Bernoulli(logits=eta), obs=y)
        >>> tr = handlers.trace(handlers.seed(model, 0)).get_trace(jnp.ones((3, 2)), jnp.ones(3))
        >>> tr["beta"]["fed"], "fed" in tr["y"]
        ({'party': 'bank'}, False)
    """

    def __init__(self, party: str, fn: Callable | None = None) -> None:
        self.party = _check_party(party, "vertical(party)")
        super().__init__(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:  # used as a decorator: wrap, keep this instance reusable
            if len(args) != 1 or kwargs or not callable(args[0]):
                raise TypeError("vertical(party)(fn) takes one callable.")
            return vertical(self.party, args[0])
        return super().__call__(*args, **kwargs)

    def __enter__(self) -> "vertical":
        outer = active_party()
        if outer is not None and outer != self.party:
            raise ValueError(
                f"Overlapping party blocks: vertical({self.party!r}) is opened inside "
                f"vertical({outer!r}); a site can belong to one party only."
            )
        super().__enter__()
        # Tell an augmentation handler (if any) that this party has a block.
        apply_stack(_query(BLOCK_MSG, self.party))
        return self

    def process_message(self, msg: dict) -> None:
        if msg["type"] in _MARKED_TYPES:
            msg.setdefault(FED_KEY, {})[PARTY_KEY] = self.party


def _query(kind: str, party: str, value: Any = None) -> dict:
    # No "name": trace does not record it, and handlers that only know sample/param/
    # plate/deterministic messages ignore it (the numpyro.prng_key() pattern).
    return {
        "type": kind,
        "party": party,
        "contribution": value,
        "fn": lambda: None,
        "args": (),
        "kwargs": {},
        "value": None,
        "handler": None,
    }


def contribution(party: str, value: Any) -> Any:
    """
    Mark ``value`` as party ``party``'s per-row contribution :math:`g_j(x_j,\\theta_j)`
    to the shared predictor (rows along the leading axis).

    Call it inside ``with vertical(party):``. Without an inference handler it returns
    ``value`` and changes nothing; under :func:`~numpyro_fed.augment` it returns what
    the augmented model needs in its place (the auxiliary :math:`z_j`).

    :param str party: the party whose block this is.
    :param value: array of shape ``(rows,)`` or ``(rows, C)``.
    :return: ``value``, or its replacement under an augmentation handler.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro_fed as nf
        >>> with nf.vertical("bank"):
        ...     nf.contribution("bank", jnp.ones(3)).shape
        (3,)
    """
    _check_party(party, "contribution(party, value)")
    block = active_party()
    if block != party:
        where = (
            "outside any vertical block"
            if block is None
            else (f"inside vertical({block!r})")
        )
        raise ValueError(
            f"nf.contribution({party!r}, ...) is called {where}: call it inside "
            f"`with nf.vertical({party!r}):`, the block that holds its coefficients."
        )
    msg = apply_stack(_query(CONTRIBUTION_MSG, party, value))
    if msg["handler"] is None:
        return value
    return msg["handler"].contribute(party, value)


def party_of(site: dict) -> str | None:
    """The party a traced site belongs to, or ``None`` for a server site."""
    return site.get(FED_KEY, {}).get(PARTY_KEY)
