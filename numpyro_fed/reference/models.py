# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The reference posteriors' models, written as a NumPyro user would write them.

Each is the published model term for term (priors, parameterization, data layout
noted per model); the group plate (school, county, student, row) is an ordinary
``numpyro.plate`` that :func:`~numpyro_fed.federate` marks as the silo plate.
"""

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

__all__ = [
    "eight_schools",
    "eight_schools_noncentered",
    "item_response_theory",
    "logistic_regression",
    "radon_contextual_effects",
]


def eight_schools(sigma, y=None):
    """Inference Gym's ``EightSchools``: centered, so its posterior is a funnel in
    ``(log_stddev, school_effects)``.

    :param sigma: ``(8,)`` known standard errors of the schools' estimates.
    :param y: ``(8,)`` estimated treatment effects.
    """
    avg_effect = numpyro.sample("avg_effect", dist.Normal(0.0, 10.0))
    log_stddev = numpyro.sample("log_stddev", dist.Normal(5.0, 1.0))
    with numpyro.plate("school", sigma.shape[0]):
        effect = numpyro.sample(
            "school_effects", dist.Normal(avg_effect, jnp.exp(log_stddev))
        )
        numpyro.sample("y", dist.Normal(effect, sigma), obs=y)


def eight_schools_noncentered(sigma, y=None):
    """posteriordb's ``eight_schools_noncentered`` (``tau ~ cauchy(0, 5)`` with
    ``tau > 0`` is a half-Cauchy).

    :param sigma: ``(8,)`` known standard errors.
    :param y: ``(8,)`` estimated treatment effects.
    """
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", sigma.shape[0]):
        theta_trans = numpyro.sample("theta_trans", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(mu + tau * theta_trans, sigma), obs=y)


def radon_contextual_effects(
    log_uranium, floor_by_county, floor, home, log_radon=None, scale_prior="uniform"
):
    """Inference Gym's ``RadonContextualEffects``: one row per county, its homes
    along the last axis (padded; ``home`` is False on padding).

    :param log_uranium: ``(J,)`` log soil uranium of each county.
    :param floor_by_county: ``(J,)`` mean floor of the county's homes.
    :param floor: ``(J, H)`` floor of each home (0: basement, 1: first floor).
    :param home: ``(J, H)`` booleans, True for real homes.
    :param log_radon: ``(J, H)`` log radon activity.
    :param str scale_prior: ``"uniform"`` (``Uniform(0, 100)`` on both scales, the
        Stan case study's) or ``"halfnormal"`` (``HalfNormal(1)``).
    """
    if scale_prior == "uniform":
        scale = dist.Uniform(0.0, 100.0)
    elif scale_prior == "halfnormal":
        scale = dist.HalfNormal(1.0)
    else:
        raise ValueError(
            f"scale_prior must be 'uniform' or 'halfnormal': {scale_prior}"
        )
    mean = numpyro.sample("county_effect_mean", dist.Normal(0.0, 1.0))
    county_scale = numpyro.sample("county_effect_scale", scale)
    weight = numpyro.sample("weight", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    obs_scale = numpyro.sample("log_radon_scale", scale)
    with numpyro.plate("county", floor.shape[0], dim=-2):
        county_effect = numpyro.sample("county_effect", dist.Normal(mean, county_scale))
        loc = (
            weight[0] * log_uranium[:, None]
            + weight[1] * floor
            + weight[2] * floor_by_county[:, None]
            + county_effect
        )
        with numpyro.plate("home", floor.shape[-1], dim=-1):
            with numpyro.handlers.mask(mask=home):
                numpyro.sample("log_radon", dist.Normal(loc, obs_scale), obs=log_radon)


def item_response_theory(answered, correct=None):
    """Inference Gym's one-parameter ``ItemResponseTheory`` on a student x question
    grid (``answered`` False where a student did not see the question).

    :param answered: ``(S, Q)`` booleans.
    :param correct: ``(S, Q)`` 0/1 answers (any value where not answered).
    """
    num_students, num_questions = answered.shape
    mean_ability = numpyro.sample("mean_student_ability", dist.Normal(0.75, 1.0))
    difficulty = numpyro.sample(
        "question_difficulty",
        dist.Normal(0.0, 1.0).expand([num_questions]).to_event(1),
    )
    with numpyro.plate("student", num_students, dim=-2):
        ability = numpyro.sample("centered_student_ability", dist.Normal(0.0, 1.0))
        with numpyro.plate("question", num_questions, dim=-1):
            with numpyro.handlers.mask(mask=answered):
                logits = ability - difficulty + mean_ability
                numpyro.sample("correct", dist.Bernoulli(logits=logits), obs=correct)


def logistic_regression(features, labels=None):
    """Inference Gym's ``LogisticRegression``: ``Normal(0, 1)`` weights, the last
    one the intercept.

    :param features: ``(N, D)`` standardized features.
    :param labels: ``(N,)`` 0/1 labels.
    """
    weights = numpyro.sample(
        "weights", dist.Normal(0.0, 1.0).expand([features.shape[-1] + 1]).to_event(1)
    )
    with numpyro.plate("row", features.shape[0]):
        logits = features @ weights[:-1] + weights[-1]
        numpyro.sample("labels", dist.Bernoulli(logits=logits), obs=labels)
