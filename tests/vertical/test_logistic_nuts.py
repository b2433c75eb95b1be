# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""T15 (seed 003 spec, slow): the paper's §5.1 logistic design (n = 500, p = 20, N(0,
1) priors, N(0, 1) noise added to the logit). Federated mean-field VI on the augmented
model against NUTS on the same augmented model, the sign of NUTS on the original
model, and the AXDA inflation of the coefficients, at most c = sqrt(1 + pi J rho^2 /
8). Never against the generating coefficients (spec §1.2).

Two NUTS references of the augmented model: NUTS on ``nf.augment(model, rho)`` itself
(an ordinary NumPyro model, with its n J auxiliaries), and NUTS on its exact marginal
over the auxiliaries (for the augmented-variable model the auxiliaries enter only
through their sum, so the marginal likelihood is the logistic likelihood convolved
with N(0, J rho^2) along the predictor: a 1-D Gauss-Hermite quadrature per row).
Seen (seed 0): NUTS on the model with auxiliaries (500 + 500 draws) is 0.11 away from
the marginal's NUTS (2000 draws) at both grid points, a mixing error along the
theta-z ridge (spec §3.11), while the federated VI is within 0.075-0.082 of it; so the
spec's 0.15 tolerance is applied against the marginal, and NUTS on ``nf.augment``
gets 0.25 (seen 0.074 at J = 2, rho = 1 and 0.158 at J = 10, rho = 0.5)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from numpy.polynomial.hermite_e import hermegauss
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
import optax
import pytest

import numpyro_fed as nf


def logistic_design(J, n=500, p=20, seed=0):
    width = p // J
    names = [f"p{j}" for j in range(J)]

    def model(y=None, **xs):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        eta = []
        for k in names:
            with nf.vertical(k):
                beta = numpyro.sample(
                    f"beta_{k}", dist.Normal(0.0, 1.0).expand([width]).to_event(1)
                )
                with numpyro.plate("rows", y.shape[0]):
                    eta.append(nf.contribution(k, xs[f"x_{k}"] @ beta))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=b + sum(eta)), obs=y)

    rng = np.random.default_rng(seed)
    x, beta = rng.normal(size=(n, p)), rng.normal(size=p)
    logit = 0.5 + x @ beta + rng.normal(size=n)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logit))).astype(float)
    data = nf.VerticalData(
        {
            k: {f"x_{k}": jnp.asarray(x[:, j * width : (j + 1) * width])}
            for j, k in enumerate(names)
        },
        {"y": jnp.asarray(y)},
    )
    return model, names, data


def marginal_augmented(names, J, rho, nodes=40):
    """The augmented-variable model with its auxiliaries integrated out exactly."""
    t, w = hermegauss(nodes)
    t, w = jnp.asarray(t), jnp.asarray(w / w.sum())
    s = math.sqrt(J) * rho

    def model(y=None, **xs):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        eta = b
        for k in names:
            x = xs[f"x_{k}"]
            beta = numpyro.sample(
                f"beta_{k}", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1)
            )
            eta = eta + x @ beta
        prob = jnp.sum(w * jax.nn.sigmoid(eta[:, None] + s * t), -1)
        numpyro.factor("y", jnp.sum(y * jnp.log(prob) + (1 - y) * jnp.log1p(-prob)))

    return model


def _nuts_means(model, data, names, key, warmup=500, samples=500):
    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, progress_bar=False)
    mcmc.run(jax.random.key(key), **data.pooled())
    draws = mcmc.get_samples()
    return np.concatenate([np.asarray(draws[f"beta_{k}"]).mean(0) for k in names])


@pytest.mark.slow
@pytest.mark.parametrize("J,rho", [(2, 1.0), (10, 0.5)], ids=["J2-rho1", "J10-rho0.5"])
def test_t15_logistic_meanfield_vi_against_nuts_on_the_augmented_model(J, rho):
    model, names, data = logistic_design(J)
    aug = nf.augment(model, rho)
    original = _nuts_means(model, data, names, 1)
    augmented = _nuts_means(aug, data, names, 2)
    marginal = _nuts_means(
        marginal_augmented(names, J, rho), data, names, 3, warmup=1000, samples=2000
    )
    # mean-field over (theta_j, z_j) couples the blocks only through the gradient
    # (slow, ADMM-like): a long constant rate, then a cosine decay
    steps = 24_000
    schedule = optax.join_schedules(
        [
            optax.constant_schedule(0.01),
            optax.cosine_decay_schedule(0.01, steps // 3, 0.1),
        ],
        [steps - steps // 3],
    )
    vfl = nf.VerticalSFVI(
        aug, nf.VerticalFamily(aux="meanfield", theta_cov="full"), optax.adam(schedule)
    )
    result = vfl.run(jax.random.key(0), steps, data, progress_bar=False)
    vi = np.concatenate([np.asarray(result.params.parties[k]["loc"]) for k in names])
    c = math.sqrt(1 + math.pi * J * rho**2 / 8)
    big = np.abs(original) > 0.3
    ratio = vi[big] / original[big]
    print(
        f"J={J} rho={rho}: max |VI - NUTS(aug)| {np.abs(vi - augmented).max():.3f}, "
        f"|VI - NUTS(marginal)| {np.abs(vi - marginal).max():.3f}, "
        f"|NUTS(aug) - NUTS(marginal)| {np.abs(augmented - marginal).max():.3f}; "
        f"VI/NUTS(orig) ratio min {ratio.min():.3f} median {np.median(ratio):.3f} "
        f"max {ratio.max():.3f} (1.05 c = {1.05 * c:.3f}); NUTS(aug)/NUTS(orig) "
        f"median {np.median(augmented[big] / original[big]):.3f}"
    )
    # seen: 0.075 (J = 2, rho = 1) and 0.082 (J = 10, rho = 0.5) against the
    # marginal; 0.074 and 0.158 against NUTS with the auxiliaries
    assert np.abs(vi - marginal).max() < 0.15
    assert np.abs(vi - augmented).max() < 0.25
    assert np.all(np.sign(vi[big]) == np.sign(original[big]))
    # seen: [1.124, 1.201] (J = 2, rho = 1, c = 1.34), [1.159, 1.340] (J = 10,
    # rho = 0.5, c = 1.41)
    assert ratio.min() >= 1.0 and ratio.max() <= 1.05 * c
