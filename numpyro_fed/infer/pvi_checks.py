# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Run-time checks that a finished PVI run has reached its fixed point: the global
q still moving over the last rounds, and the free energy drifting up (issue 22)."""

from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.expfam import GaussianNat, is_full, to_moments
from numpyro_fed.infer.rounds import loss_drift

__all__ = ["Q_TOLERANCE", "average_q", "check_run", "q_movement", "warn_unconverged"]

# The suite's tolerance (issue 22): PVI must equal the same family fitted centrally
# within 0.1 sd, so a q whose last iterates spread wider than that is not an answer.
Q_TOLERANCE = 0.1


def _marginals(q: GaussianNat) -> tuple[np.ndarray, np.ndarray]:
    """Means and marginal sds of a stacked ``(rounds, d)`` history of q."""
    mean, cov = jax.vmap(to_moments)(q)
    var = jnp.diagonal(cov, axis1=-2, axis2=-1) if is_full(q) else cov
    return np.asarray(mean, np.float64), np.sqrt(np.asarray(var, np.float64))


def q_movement(means: Any, sds: Any, window: int) -> tuple[float, int, str]:
    """
    How far the last ``window`` iterates of q lie from the last one: the largest
    ``|mean_r - mean_last| / sd_last`` or ``|log(sd_r / sd_last)|`` over those rounds
    and coordinates, with its coordinate and ``"mean"`` or ``"sd"``. At a fixed point
    it is 0; round-to-round Monte Carlo noise or a trend both show as a gap.

    :param means: ``(rounds, d)`` means of q, one row per round.
    :param sds: ``(rounds, d)`` marginal sds of q.
    :param int window: how many of the last rounds to compare.

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> from numpyro_fed.infer.pvi_checks import q_movement
        >>> means = np.array([[0.0], [0.5], [1.0]])
        >>> q_movement(means, np.ones((3, 1)), 2)
        (0.5, 0, 'mean')
    """
    means, sds = np.asarray(means, np.float64), np.asarray(sds, np.float64)
    last_m, last_s = means[-window:], sds[-window:]
    if not (np.all(np.isfinite(last_m)) and np.all(last_s > 0)):
        return 0.0, 0, "mean"  # a broken q is reported by the server's own checks
    gap_m = np.abs(last_m - last_m[-1]).max(0) / last_s[-1]
    gap_s = np.abs(np.log(last_s / last_s[-1])).max(0)
    if gap_m.max() >= gap_s.max():
        return float(gap_m.max()), int(gap_m.argmax()), "mean"
    return float(gap_s.max()), int(gap_s.argmax()), "sd"


def average_q(q_history: GaussianNat, window: int) -> GaussianNat:
    """The mean of the natural parameters of the last ``window`` rounds' q (a
    Gaussian: precisions average to a positive definite one)."""
    return jax.tree.map(lambda h: jnp.mean(h[-window:], 0), q_history)


def _halves_gap(q_history: GaussianNat, window: int) -> tuple[float, int, str]:
    """:func:`q_movement` between the averages of the first and the second half of
    the last ``window`` rounds' q."""
    half = window // 2
    first = jax.tree.map(lambda h: h[-2 * half : -half], q_history)
    pair = jax.tree.map(
        lambda a, b: jnp.stack([a, b]),
        average_q(first, half),
        average_q(q_history, half),
    )
    means, sds = _marginals(pair)
    return q_movement(means.reshape(2, -1), sds.reshape(2, -1), 2)


def warn_unconverged(
    name: str, losses: Any, q_history: GaussianNat, average: int = 1
) -> None:
    """Warn when a finished run of ``len(losses)`` rounds has not settled, or its
    free energy drifted up from its best (the Monte Carlo error of the local solves
    piling up). Settled: with ``average`` = 1 (the last q is the answer), q moved by
    at most :data:`Q_TOLERANCE` sds over the last rounds; with the average of the last
    ``average`` rounds' q as the answer, the averages of the two halves of those
    rounds agree within :data:`Q_TOLERANCE` sds. Their difference holds any trend
    and twice the answer's own Monte Carlo standard error, so an answer that passes
    is within about half the tolerance of the mean of the rounds it averages.

    :param str name: the algorithm's name, for the messages.
    :param losses: the free energy of every round.
    :param GaussianNat q_history: the global q of every round, stacked.
    :param int average: how many of the last rounds' q the answer averages.
    """
    losses = np.asarray(losses, np.float64)
    rounds = len(losses)
    window = min(max(rounds // 10, 5), rounds)
    if average >= 4:
        gap, coord, what = _halves_gap(q_history, average)
        if gap > Q_TOLERANCE:
            size = f"{gap:.3g} sd" if what == "mean" else f"a factor {np.exp(gap):.3g}"
            half = average // 2
            warnings.warn(
                f"{name} has not reached its fixed point: the returned q averages "
                f"rounds {rounds - average + 1}-{rounds}, and the {what} of "
                f"coordinate {coord} differs by {size} between the average of rounds "
                f"{rounds - 2 * half + 1}-{rounds - half} and that of rounds "
                f"{rounds - half + 1}-{rounds} (tolerance {Q_TOLERANCE} sd): q is "
                "still trending, or jitters too much for this many rounds. Run more "
                "rounds; or use more num_particles (less Monte Carlo error in the "
                "local solves).",
                stacklevel=4,
            )
    elif rounds >= 2:
        means, sds = _marginals(q_history)
        gap, coord, what = q_movement(
            means.reshape(rounds, -1), sds.reshape(rounds, -1), window
        )
        if gap > Q_TOLERANCE:
            size = (
                f"{gap:.3g} of its sd"
                if what == "mean"
                else f"a factor {np.exp(gap):.3g}"
            )
            warnings.warn(
                f"{name} has not reached its fixed point: over rounds "
                f"{rounds - window + 1}-{rounds} the {what} of q's coordinate {coord} "
                f"still moved by {size} (tolerance {Q_TOLERANCE} sd), so the returned "
                "q is one iterate of a moving or noisy sequence. Run more rounds if it "
                "is still trending; if it jitters round to round, use more local_steps "
                "and num_particles (less Monte Carlo error in the local solves) or "
                "more damping.",
                stacklevel=4,
            )
    rise, z = loss_drift(losses, window)
    if z > 4 and rise > 1e-3 * abs(float(np.min(losses))):
        warnings.warn(
            f"{name}: the free energy of the last {window} rounds is "
            f"{rise:.4g} worse than at its best ({z:.3g} standard errors): the "
            "Monte Carlo error of the local solves is piling up across silos. "
            "Use more local_steps and num_particles, more damping, or "
            "local_solver='natural'.",
            stacklevel=4,
        )


def check_run(name: str, result: Any, average: int) -> GaussianNat:
    """Warn about a finished PVI ``result`` (a :class:`~numpyro_fed.RunResult`):
    rounds where the server shrank an update to keep q valid, and a q not settled
    (:func:`warn_unconverged`); return the average of the last ``average`` rounds'
    q."""
    rounds = len(result.losses)
    scale = np.asarray(result.history["scale"]).reshape(rounds, -1).min(1)
    shrunk = int(np.sum(scale < 1))
    if shrunk:
        warnings.warn(
            f"In {shrunk} round(s) the server shrank an update (smallest applied "
            f"fraction {float(scale.min()):.3g}) to keep q a valid Gaussian; "
            "consider more damping.",
            stacklevel=3,
        )
    q_history = jax.tree.map(  # the q at the end of each round
        lambda h, f: jnp.reshape(h, (rounds, -1) + f.shape)[:, -1],
        result.history["q"],
        result.state.server.q,
    )
    warn_unconverged(name, result.losses, q_history, average)
    return average_q(q_history, average)
