# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The non-finite guard: one wrapper over the contract, for every algorithm.

A silo whose data or local fit overflows must not move anyone else's result. The
guard composes with any :class:`~numpyro_fed.protocol.FederatedAlgorithm` (as optax's
``apply_if_finite`` wraps an optimizer) and gives it two rules:

- **on the silo**, a step whose reply or new state is not finite is not taken: the
  silo keeps its state, as NumPyro's ``stable_update`` keeps the parameters, and
  replies NaN, so that the server counts the failure even when only the silo's own
  state overflowed;
- **on the server**, a reply that is not finite is removed before the algorithm sees
  it: its row is zeroed (a zero weight times NaN is still NaN), its silo counts as not
  having replied, and it is marked in ``info.rejected``. A server step that is not
  finite from finite replies (an overflowing sum, a learning rate that turned NaN) is
  not taken either, and every contacted silo is marked: the round is void.

So a rejected reply has exactly the effect of a silo that did not take part in the
round, which is what the algorithms' own rules for partial participation handle
(SFVI rescales its sum, SFVI-Avg re-weights its barycenter, PVI and FSGLD skip the
silo). An algorithm whose round needs every silo (vertical FL: the likelihood needs
every party's auxiliary) asks for ``all_or_nothing``: any rejection leaves the server
state as it was.

The guard keeps a bad reply out of the aggregate, so the run goes on; but a silo
rejected round after round has silently left the posterior. Runs therefore report
every rejection by name (:func:`check_rejections`) and stop with
:class:`SiloFailure` when a silo was rejected in more than a set fraction of the
rounds it was contacted in.
"""

from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.protocol import (
    FederatedAlgorithm,
    Message,
    SiloData,
    SummedReplies,
    reply_sum,
)
from numpyro_fed.util import all_finite, rows_where, tree_where

__all__ = [
    "SiloFailure",
    "check_rejections",
    "finite_rows",
    "guard_nonfinite",
    "guarded_sum",
    "rejection_counts",
    "sums_finite",
]


def guard_nonfinite(
    algorithm: FederatedAlgorithm, *, all_or_nothing: bool = False
) -> FederatedAlgorithm:
    """
    ``algorithm`` with non-finite silo steps and replies rejected.

    :param FederatedAlgorithm algorithm: any algorithm; its ``server_step`` info must
        have a ``rejected`` field (``(J,)`` booleans).
    :param bool all_or_nothing: the server takes no step in a round in which any
        contacted silo's reply was rejected.
    :return: the guarded :class:`~numpyro_fed.protocol.FederatedAlgorithm`.

    **Example:**

    .. doctest::

        >>> from typing import NamedTuple
        >>> import jax.numpy as jnp
        >>> from numpyro_fed.guard import guard_nonfinite
        >>> from numpyro_fed.protocol import FederatedAlgorithm, Message
        >>> class Info(NamedTuple):
        ...     loss: jnp.ndarray
        ...     rejected: jnp.ndarray
        >>> mean_of_replies = FederatedAlgorithm(
        ...     init_server=lambda key: jnp.zeros(()),
        ...     init_silo=lambda key, data: jnp.zeros(()),
        ...     server_message=lambda state, key: Message(state),
        ...     silo_step=lambda message, state, data, key: (data, state),
        ...     server_step=lambda state, replies, key, used: (
        ...         jnp.sum(jnp.where(used, replies, 0.0)) / jnp.sum(used),
        ...         Info(jnp.zeros(()), used & False),
        ...     ),
        ... )
        >>> guarded = guard_nonfinite(mean_of_replies)
        >>> replies = jnp.array([1.0, jnp.nan, 3.0])
        >>> state, info = guarded.server_step(
        ...     jnp.zeros(()), replies, None, jnp.ones(3, bool))
        >>> float(state), info.rejected.tolist()
        (2.0, [False, True, False])
    """
    inner_silo_step = algorithm.silo_step
    inner_server_step = algorithm.server_step

    def silo_step(message: Message, state: Any, data: SiloData, key: jax.Array):
        reply, new_state = inner_silo_step(message, state, data, key)
        ok = all_finite((reply, new_state))
        return tree_where(ok, reply, _nan_like(reply)), tree_where(ok, new_state, state)

    def server_step(state: Any, replies: Any, key: jax.Array, participating: Any):
        if isinstance(replies, SummedReplies):
            finite = replies.used | ~participating
            used = participating & replies.used
            clean = replies._replace(used=used)
        else:
            finite = jax.vmap(all_finite)(replies)
            used = participating & finite
            clean = rows_where(used, replies, jax.tree.map(jnp.zeros_like, replies))
        new_state, info = inner_server_step(state, clean, key, used)
        rejected = participating & ~finite
        server_ok = all_finite(new_state)
        rejected = jnp.where(server_ok, rejected, participating)
        keep = ~server_ok | (jnp.any(rejected) if all_or_nothing else False)
        new_state = tree_where(keep, state, new_state)
        return new_state, info._replace(rejected=info.rejected | rejected)

    # reduce_silos keeps the silo rule itself (guarded_sum): a sum cannot be taken
    # apart afterwards.
    return algorithm._replace(silo_step=silo_step, server_step=server_step)


def finite_rows(
    contacted: jax.Array, replies: Any, new_states: Any, states: Any
) -> tuple[jax.Array, Any]:
    """The guard's silo rule inside a ``reduce_silos``: ``(used, states)``, the
    contacted silos whose replies (any per-silo pytree the sum is taken from) and
    new states are finite, and the states with only those silos stepped (the others
    keep theirs). ``used`` goes into :class:`~numpyro_fed.protocol.SummedReplies`.

    :param jax.Array contacted: ``(J,)`` booleans.
    :param replies: the per-silo quantities summed into the reply (leading silo axis).
    :param new_states: the silos' stepped states (leading silo axis).
    :param states: their states before the step.
    """
    finite = jax.vmap(all_finite)((replies, new_states))
    used = contacted & finite
    return used, rows_where(used, new_states, states)


def guarded_sum(
    contacted: jax.Array, summands: Any, new_states: Any, states: Any
) -> tuple[jax.Array, Any, Any]:
    """The guard's silo rule and the sum of the replies inside a ``reduce_silos``:
    ``(used, total, states)``, as :func:`finite_rows` gives ``used`` and the states
    and :func:`~numpyro_fed.protocol.reply_sum` the total over ``used``, bit for bit.

    A sum that holds a NaN or an infinity is not finite. So when the contacted
    silos' summed replies and the sum of every silo's new state are finite, every
    contacted silo passes the rule and the per-silo checks are skipped (on CPU, by a
    branch; accelerators, where a branch waits for the device, always run them).
    Otherwise (a silo that is not finite, or finite values whose sum overflows) the
    rule runs silo by silo and the sum is taken again over the silos that pass.

    :param jax.Array contacted: ``(J,)`` booleans.
    :param summands: the per-silo quantities summed into the reply (leading silo
        axis).
    :param new_states: the silos' stepped states (leading silo axis).
    :param states: their states before the step.
    """
    total = reply_sum(summands, contacted)

    def per_silo(total: Any) -> tuple[jax.Array, Any]:
        del total
        used, _ = finite_rows(contacted, summands, new_states, states)
        return used, reply_sum(summands, used)

    def all_contacted(total: Any) -> tuple[jax.Array, Any]:
        return contacted, total

    def branch(total: Any) -> tuple[jax.Array, Any]:
        # The branches return only (J,) booleans and the small total, so the
        # selection below still fuses with the step.
        finite = sums_finite(total, new_states)
        return jax.lax.cond(finite, all_contacted, per_silo, total)

    used, total = jax.lax.platform_dependent(total, cpu=branch, default=per_silo)
    return used, total, rows_where(used, new_states, states)


def sums_finite(total: Any, new_states: Any) -> jax.Array:
    """Whether the summed replies ``total`` and the sum of each floating leaf of the
    silos' ``new_states`` are all finite: one reduction per leaf, which passes every
    silo that is finite (a NaN or an infinity anywhere makes its sum so; a finite
    sum that overflows sends the caller to its per-silo checks, which are exact)."""
    sums = [
        jnp.sum(x)
        for x in jax.tree.leaves(new_states)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return all_finite((total, sums))


def _nan_like(tree: Any) -> Any:
    def nan(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.full_like(x, jnp.nan)
        return x

    return jax.tree.map(nan, tree)


class SiloFailure(RuntimeError):
    """Silos whose replies were rejected too often for the result to stand for them.

    - **silos** - the failing silos' indices.
    - **rejected** - ``(J,)``: each silo's rejected replies.
    - **contacted** - ``(J,)``: the rounds each silo was contacted in.
    - **result** - the run's :class:`~numpyro_fed.infer.driver.RunResult` (the
      rejected replies never touched it), so nothing computed is lost.
    """

    def __init__(
        self,
        message: str,
        silos: list,
        rejected: np.ndarray,
        contacted: np.ndarray,
        result: Any = None,
    ) -> None:
        super().__init__(message)
        self.silos = silos
        self.rejected = rejected
        self.contacted = contacted
        self.result = result


def rejection_counts(history: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """``(rejected, contacted)``: per silo, the replies the server rejected and the
    rounds it was contacted in, from a run's history (``None`` when the history
    records no rejections)."""
    rejected = history.get("rejected")
    if rejected is None:
        return None
    rejected = np.asarray(rejected)
    num_silos = rejected.shape[-1]
    # The events runtime records one row per event: a round rejects a silo once.
    per_round = (
        rejected.any(1) if rejected.ndim == 3 else rejected.reshape(-1, num_silos)
    )
    contacted = history.get("contacted")
    if contacted is None:
        contacted = np.ones_like(per_round)
    contacted = np.asarray(contacted).reshape(-1, num_silos)
    return per_round.sum(0), contacted.sum(0)


def check_rejections(
    name: str,
    history: dict,
    max_rejected: float | None,
    result: Any = None,
    *,
    warn: bool = True,
    labels: Any = None,
) -> None:
    """
    Warn about the silos whose replies were rejected; raise :class:`SiloFailure` for
    those rejected in more than ``max_rejected`` of the rounds they were contacted in.

    :param str name: the algorithm's name, for the messages.
    :param dict history: the run's history (``rejected``, optionally ``contacted``).
    :param float max_rejected: the largest tolerated fraction (``None``: never
        raise).
    :param result: what the run computed, attached to the error.
    :param bool warn: also warn about rejections below the threshold.
    :param labels: ``labels[j]`` names silo j (default ``"silo j"``).
    """
    counts = rejection_counts(history)
    if counts is None or not counts[0].any():
        return
    rejected, contacted = counts
    fraction = rejected / np.maximum(contacted, 1)
    label = (lambda j: f"silo {j}") if labels is None else (lambda j: labels[j])
    silos = np.flatnonzero(rejected)
    listed = ", ".join(
        f"{label(j)} ({rejected[j]} of {contacted[j]} rounds)" for j in silos[:10]
    )
    more = f" and {len(silos) - 10} more" if len(silos) > 10 else ""
    failing = (
        np.zeros(0, np.intp)
        if max_rejected is None
        else np.flatnonzero(fraction > max_rejected)
    )
    if len(failing):
        raise SiloFailure(
            f"{name} stopped: the replies of {', '.join(map(label, failing))} were "
            f"not finite or not valid in more than {max_rejected:.0%} of the rounds they "
            f"took part in ({listed}{more}), so the result would silently leave their "
            "data out. Check those silos' data and the learning rate; pass "
            "max_rejected=None to the algorithm to continue without them (the run's "
            "result is in this error's .result).",
            failing.tolist(),
            rejected,
            contacted,
            result,
        )
    if warn:
        warnings.warn(
            f"{name} rejected {int(rejected.sum())} silo replies that were not finite "
            f"or not valid: {listed}{more}. Their data were left out of those rounds; "
            "see result.history['rejected'].",
            stacklevel=3,
        )
