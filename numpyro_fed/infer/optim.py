# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The optimizer the VI classes use when none is given."""

import jax.numpy as jnp
import optax

__all__ = ["default_optimizer"]


def default_optimizer(
    learning_rate: float = 1e-2, constant_steps: int = 1000
) -> optax.GradientTransformation:
    """
    Adam whose rate stays at ``learning_rate`` for ``constant_steps`` steps and then
    decays as :math:`1/t`: :math:`\\alpha_t = \\alpha \\min(1, T_0 / (t + 1))`.

    At a constant rate a one-particle ELBO fit does not converge: it wanders about
    its optimum at a distance set by the rate (0.1-0.13 posterior sd on eight
    schools at 0.01, from 2,000 to 32,000 steps). The :math:`1/t` tail is the
    Robbins-Monro schedule: its steps still sum to infinity, so the fit keeps
    moving (:math:`\\alpha T_0 \\ln(t / T_0)` of Adam's unit steps by step
    :math:`t`), while its noise dies out. It needs no horizon, so a run resumed
    with more steps continues the same schedule, and ``update`` works without
    ``run``.

    :param float learning_rate: Adam's rate for the first ``constant_steps`` steps.
    :param int constant_steps: :math:`T_0`.
    :rtype: optax.GradientTransformation

    **Example:**

    .. doctest::

        >>> from numpyro_fed.infer.optim import default_optimizer
        >>> import jax.numpy as jnp, optax
        >>> opt = default_optimizer()
        >>> state = opt.init(jnp.zeros(1))
        >>> round(float(opt.update(jnp.ones(1), state)[0][0]), 6)
        -0.01
    """
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be positive, got {learning_rate!r}.")
    if not (isinstance(constant_steps, int) and constant_steps >= 1):
        raise ValueError(
            f"constant_steps must be a positive integer, got {constant_steps!r}."
        )

    def rate(count):
        return learning_rate * jnp.minimum(1.0, constant_steps / (count + 1.0))

    return optax.adam(rate)
