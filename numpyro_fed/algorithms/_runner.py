# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The ``run`` loop shared by the VI wrappers: NumPyro's two modes (``lax.scan``
without a progress bar; one jitted step and a tqdm bar with it)."""

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import trange

__all__ = ["RunResult", "run_loop"]


class RunResult(NamedTuple):
    """- **params** - the final (constrained) parameters.
    - **state** - the final state, to resume with ``run(..., init_state=state)``.
    - **losses** - the negative ELBO estimate of every round.
    """

    params: Any
    state: Any
    losses: jax.Array


def run_loop(
    step: Callable[[Any], tuple[Any, jax.Array]],
    state: Any,
    num_steps: int,
    *,
    progress_bar: bool = True,
    scan: bool = True,
    description: str = "rounds",
) -> tuple[Any, jax.Array]:
    """Apply a jitted ``step(state) -> (state, loss)`` ``num_steps`` times: inside one
    ``lax.scan`` when there is no progress bar and ``scan`` is allowed, otherwise in
    a Python loop."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}.")
    if not progress_bar and scan:

        def body(carry, _):
            return step(carry)

        return lax.scan(body, state, None, length=num_steps)
    losses = []
    batch = max(num_steps // 20, 1)
    with trange(1, num_steps + 1, desc=description, disable=not progress_bar) as bar:
        for i in bar:
            state, loss = step(state)
            losses.append(loss)
            if progress_bar and i % batch == 0:
                recent = np.asarray(jax.device_get(jnp.stack(losses[-batch:])))
                bar.set_postfix_str(
                    f"avg. loss [{i - batch + 1}-{i}]: {recent.mean():.4f}",
                    refresh=False,
                )
    return state, jnp.stack(losses)
