# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The loop under :meth:`Driver.run <numpyro_fed.infer.driver.Driver.run>`: rounds in
``lax.scan`` chunks (or one jitted round at a time under a progress bar) that end at
the checkpoints, and a stopping rule, :class:`Plateau`, read at window ends."""

from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import trange

from numpyro_fed.runtime.checkpoint import concat_rounds
from numpyro_fed.util import stack

__all__ = ["Plateau", "loss_drift", "run_rounds"]


class Plateau(NamedTuple):
    """
    Stop a run once its loss has stopped moving: at the end of every ``window``
    rounds, the mean loss of that window is compared with the window before, and
    the run stops when they differ by less than ``rtol`` times its size or by less
    than their standard error (what is left of the change is Monte Carlo noise).

    With a constant learning rate a stochastic fit then sits at its noise floor, so
    a decaying rate (e.g. ``optax.exponential_decay``) over the ``num_steps`` given
    as the budget reaches a smaller one before the rule stops it.

    :param int window: rounds per window.
    :param float rtol: relative change of the window mean below which the run stops.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> from numpyro_fed.infer.rounds import Plateau
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with numpyro.plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> data = nf.FederatedData.from_groups([0, 0, 1, 1], y=jnp.arange(4.0))
        >>> fed = nf.federate(model, silos="data")
        >>> svi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.05))
        >>> result = svi.run(jax.random.key(0), 20_000, data, progress_bar=False,
        ...                  stop=Plateau(window=100))
        >>> len(result.losses) < 20_000  # stopped at a window's end
        True
        >>> len(result.losses) % 100
        0
    """

    window: int = 100
    rtol: float = 1e-4

    def reached(self, losses: Any) -> bool:
        """Whether ``losses`` (every round so far) end a window on a plateau."""
        losses = np.asarray(losses, np.float64)
        n, w = len(losses), self.window
        if n < 2 * w or n % w:
            return False
        before, last = losses[n - 2 * w : n - w], losses[n - w :]
        if not np.all(np.isfinite(last)):
            return False
        change = abs(last.mean() - before.mean())
        noise = np.sqrt((before.var(ddof=1) + last.var(ddof=1)) / w)
        return bool(change <= max(self.rtol * abs(last.mean()), noise))


def loss_drift(losses: Any, window: int) -> tuple[float, float]:
    """
    ``(rise, z)``: how far the mean loss of the last ``window`` rounds sits above the
    best (lowest) mean of the earlier whole windows, and that rise in standard
    errors of the difference (``inf`` for a noise-free rise; ``(0, 0)`` when the
    last window is not above, or there are fewer than three windows).

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> from numpyro_fed.infer.rounds import loss_drift
        >>> loss_drift(np.r_[np.full(20, 1.0), np.full(10, 3.0)], 10)
        (2.0, inf)
    """
    losses = np.asarray(losses, np.float64)
    k = len(losses) // window
    if k < 3:
        return 0.0, 0.0
    windows = losses[len(losses) - k * window :].reshape(k, window)
    if not np.all(np.isfinite(windows)):
        return 0.0, 0.0
    means = windows.mean(1)
    best = int(np.argmin(means[:-1]))
    rise = float(means[-1] - means[best])
    if rise <= 0:
        return 0.0, 0.0
    se = np.sqrt((windows[best].var(ddof=1) + windows[-1].var(ddof=1)) / window)
    return rise, float(rise / se) if se > 0 else float("inf")


def check_plateau(stop: Any) -> Plateau | None:
    """``stop`` as a :class:`Plateau` (``None`` passes), or a clear error."""
    if stop is None:
        return None
    if not isinstance(stop, Plateau):
        raise TypeError(
            f"stop must be a numpyro_fed.infer.rounds.Plateau or None, got {stop!r}."
        )
    if int(stop.window) < 2 or not stop.rtol >= 0:
        raise ValueError(
            f"Plateau needs window >= 2 and rtol >= 0, got window={stop.window}, "
            f"rtol={stop.rtol}."
        )
    return stop


def run_rounds(
    step_fn: Callable,
    scans: Callable,
    state: Any,
    *,
    done: int,
    num_steps: int,
    scan: bool,
    progress_bar: bool,
    saver: Any = None,
    check: Callable = lambda before, info: None,
    stop: Plateau | None = None,
    past: dict | None = None,
    description: str = "rounds",
) -> tuple[Any, dict | None]:
    """
    Rounds ``done + 1 .. num_steps`` (fewer when ``stop`` is reached).

    :param step_fn: ``state -> (state, record)``, one jitted round.
    :param scans: ``length -> (state -> (state, records))``, that many rounds in
        one compiled ``lax.scan``.
    :param bool scan: use ``scans`` (in chunks ending at checkpoints and window
        ends), else ``step_fn`` one round at a time under a tqdm bar.
    :param saver: the run's :class:`~numpyro_fed.runtime.checkpoint.RunCheckpoints`.
    :param check: ``(state before, info) -> None``, raising on an info that must
        stop the run.
    :param Plateau stop: the stopping rule, read at window ends.
    :param dict past: the history of rounds ``1 .. done`` (resumed).
    :return: ``(state, history of the rounds run)`` (``None``: none were run).
    """
    past_losses = [] if past is None else [np.asarray(past["loss"])]
    if done == num_steps or (
        stop is not None and stop.reached(np.concatenate([np.zeros(0), *past_losses]))
    ):
        return state, None  # a resumed run that had ended (or stopped on a plateau)

    def next_end(start: int) -> int:
        end = num_steps if saver is None else saver.next_stop(start, num_steps)
        if stop is not None:
            end = min(end, (start // stop.window + 1) * stop.window)
        return end

    def stops(records_losses: list) -> bool:
        losses = np.concatenate([*past_losses, *map(np.asarray, records_losses)])
        return stop is not None and stop.reached(losses)

    if scan:
        chunks: list = []
        start = done
        while start < num_steps:
            end = next_end(start)
            before = state
            state, history = scans(end - start)(state)
            check(before, SimpleNamespace(**history))
            chunks.append(history)
            if saver is not None and (saver.next_stop(start, num_steps) == end):
                saver.save(state, concat_rounds(*chunks), end)
            start = end
            if stops([c["loss"] for c in chunks]):
                if saver is not None:
                    saver.save(state, concat_rounds(*chunks), end)
                break
        return state, concat_rounds(*chunks)

    records: list = []
    batch = max(num_steps // 20, 1)
    with trange(
        done + 1, num_steps + 1, desc=description, disable=not progress_bar
    ) as bar:
        for i in bar:
            before = state
            state, record = step_fn(state)
            check(before, SimpleNamespace(**record))
            records.append(record)
            at_window = stop is not None and i % stop.window == 0
            ended = at_window and stops([jnp.stack([r["loss"] for r in records])])
            if saver is not None and (saver.next_stop(i - 1, num_steps) == i or ended):
                saver.save(state, stack(records), i)
            if progress_bar and i % batch == 0:
                losses = [r["loss"] for r in records[-batch:]]
                recent = np.asarray(jax.device_get(jnp.stack(losses)))
                bar.set_postfix_str(
                    f"avg. loss [{i - len(recent) + 1}-{i}]: {recent.mean():.4f}",
                    refresh=False,
                )
            if ended:
                break
    return state, stack(records)
