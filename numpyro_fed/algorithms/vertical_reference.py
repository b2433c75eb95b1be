# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Centralized references for vertical federated VI: the joint single-sample ELBO of
a round (computed with NumPyro's ``log_density`` on pooled data), which the message
protocol's gradients must reproduce, and the family as an ordinary NumPyro guide."""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro import handlers
import numpyro.distributions as dist
from numpyro.infer.util import log_density

from numpyro_fed.densities import constrain_site
from numpyro_fed.vertical.augment import z_name
from numpyro_fed.vertical.data import VerticalData
from numpyro_fed.vertical.structure import SERVER, VerticalStructure, fill_values

__all__ = ["joint_elbo", "numpyro_guide"]


def _sg(tree: Any) -> Any:
    return jax.lax.stop_gradient(tree)


def joint_elbo(
    vfl: Any, raws: dict, rng_key: jax.Array, data: VerticalData
) -> jax.Array:
    """
    The single-sample ELBO of the round drawn from ``rng_key`` (same noise and
    rows as :meth:`update`), computed jointly on pooled data with NumPyro's
    ``log_density`` of the whole augmented model: the reference that the message
    protocol's gradients must reproduce.

    :param VerticalSFVI vfl: the algorithm, set up on ``data``.
    :param dict raws: owner -> raw parameters (``state.parties[p].raw``, and
        ``state.server.raw`` under ``"server"``).
    :param jax.random.key rng_key: the round's key (``state.rng_key``).
    :param VerticalData data: the data.
    """
    fam, st = vfl.family, vfl.structure
    _, r = vfl.round_keys(rng_key)
    arrays = data.pooled()
    alg_noise = {}
    values, log_q = {}, jnp.zeros(())
    for owner in st.parties + (SERVER,):
        p = fam.constrain(owner, raws[owner])
        p_q = _sg(p) if vfl.stl else p
        key = r.server_key if owner == SERVER else r.party_keys[owner]
        k1, k2 = jax.random.split(key)
        eps = jax.random.normal(k1, (fam.dim(owner),))
        draw, lq = fam.draw_latents(owner, p, p_q, eps)
        values.update(draw)
        values.update(p["param"])
        log_q = log_q + lq
        alg_noise[owner] = (p, p_q, k2)
    rows = st.rows
    if rows is not None and rows[2] < rows[1]:
        values[rows[0]] = r.idx
    seeded = handlers.seed(
        handlers.substitute(vfl.model.run, data=fill_values(st, values)),
        jax.random.key(0),
    )
    _, h = seeded("probe", **arrays)
    y = None
    if fam.aux == "amortized" and st.kind == "power":
        y = next(iter(h.likelihood.values()))["value"]
    for party in st.parties:
        p, p_q, k2 = alg_noise[party]
        tau = jax.random.normal(k2, st.z_shape[party])
        u = h.contributions[party]
        zd = fam.z_dist(party, p, u, y, r.idx)
        z = zd.loc + zd.scale * tau
        log_q = (
            log_q + st.z_scale * fam.z_dist(party, p_q, u, y, r.idx).log_prob(z).sum()
        )
        values[z_name(party)] = z
    model_params = {k: v for k, v in values.items() if k in _param_names(st)}
    latent = {k: v for k, v in values.items() if k not in model_params}
    log_joint, _ = log_density(
        handlers.substitute(vfl.model, data=model_params), (), arrays, latent
    )
    return log_joint - log_q


def numpyro_guide(vfl: Any, init_raws: dict) -> Callable:
    """
    The family as an ordinary NumPyro guide of the augmented model (full-batch
    only), for centralized ``SVI`` or ``Trace_ELBO`` on pooled data. Its
    ``numpyro.param`` sites are named ``"_vfl/{owner}/{leaf}"``; the model's
    own ``numpyro.param`` sites stay in the model.

    :param VerticalSFVI vfl: the algorithm, set up on the data.
    :param dict init_raws: owner -> raw parameters to start from.
    """
    fam, st, model = vfl.family, vfl.structure, vfl.model
    rows = st.rows
    if rows is not None and rows[2] < rows[1]:
        raise NotImplementedError(
            "numpyro_guide() is full-batch; the rows plate is subsampled."
        )
    owners = st.parties + (SERVER,)

    def guide(**arrays):
        values, raws = {}, {}
        for owner in owners:
            leaves, tree = jax.tree_util.tree_flatten_with_path(init_raws[owner])
            new = []
            for path, leaf in leaves:
                if _path_str(path).startswith("param"):
                    new.append(leaf)  # model params are the model's own sites
                    continue
                new.append(numpyro.param(f"_vfl/{owner}/{_path_str(path)}", leaf))
            raws[owner] = jax.tree_util.tree_unflatten(tree, new)
            p = fam.constrain(owner, raws[owner])
            values.update(p["param"])
            if "loc" not in p:
                continue
            flat = numpyro.sample(
                f"_vfl/{owner}/latent",
                fam.theta_dist(p),
                infer={"is_auxiliary": True},
            )
            start = 0
            for name, spec in sorted(st.latents[owner].items()):
                size = int(np.prod(spec.unconstrained_shape))
                x = flat[start : start + size].reshape(spec.unconstrained_shape)
                start += size
                v, log_det = constrain_site(spec.support, x)
                log_det = jnp.sum(log_det)
                values[name] = numpyro.sample(
                    name,
                    dist.Delta(v, log_density=-log_det, event_dim=len(spec.shape)),
                )
        probe = handlers.block(
            handlers.seed(
                handlers.substitute(model.run, data=fill_values(st, values)),
                jax.random.key(0),
            )
        )
        _, h = probe("probe", **arrays)
        y = None
        if fam.aux == "amortized" and st.kind == "power":
            y = next(iter(h.likelihood.values()))["value"]
        for party in st.parties:
            p = fam.constrain(party, raws[party])
            zd = fam.z_dist(party, p, h.contributions[party], y)
            numpyro.sample(z_name(party), zd.to_event(st.z_event_dim[party]))

    return guide


def _param_names(structure: VerticalStructure) -> set:
    return {n for owner in structure.params.values() for n in owner}


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
