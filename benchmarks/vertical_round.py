# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""One vertical federated round (VerticalSFVI, Algorithm 1, simulation runtime) vs
one centralized NumPyro SVI step on the same augmented model with the same family
(``vfl.numpyro_guide``), the state's size against n (amortized vs mean-field), and
J = 10 equal parties run as one vmapped call vs one after another in the round.

Ratios are against the reference measured in the same run; each time is the median
over ``--repeats`` calls, the round and the SVI step timed alternately. Writes
``benchmarks/results/vertical_round.json``.

Run: ``python benchmarks/vertical_round.py [--repeats 200]``.
"""

import argparse
import json
import pathlib
import platform
import time

from _timing import interleaved_times  # benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
import optax

import numpyro_fed as nf

jax.config.update("jax_enable_x64", True)


def model(x_a, x_b, y=None):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    etas = []
    for party, x in (("a", x_a), ("b", x_b)):
        with nf.vertical(party):
            beta = numpyro.sample(
                f"beta_{party}", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1)
            )
            with numpyro.plate("rows", x.shape[0]):
                etas.append(nf.contribution(party, x @ beta))
    with numpyro.plate("rows", x_a.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b + sum(etas)), obs=y)


def make_data(n, p=20, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p))
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-(x @ rng.normal(size=p))))).astype(
        float
    )
    return nf.VerticalData(
        {
            "a": {"x_a": jnp.asarray(x[:, : p // 2])},
            "b": {"x_b": jnp.asarray(x[:, p // 2 :])},
        },
        {"y": jnp.asarray(y)},
    )


def round_vs_svi(n, aux, repeats):
    data = make_data(n)
    aug = nf.augment(model, 1.0)
    vfl = nf.VerticalSFVI(aug, nf.VerticalFamily(aux=aux), optax.adam(1e-2))
    state = vfl.init(jax.random.key(0), data)
    step = round_step(vfl, data)
    parties = vfl.party_states(state)
    raws = {"server": state.server.raw, **{p: s.raw for p, s in parties.items()}}
    svi = SVI(aug, vfl.numpyro_guide(raws), optax.adam(1e-2), Trace_ELBO())
    svi_state = svi.init(jax.random.key(0), **data.pooled())
    update = jax.jit(lambda s: svi.update(s, **data.pooled()))
    t_fed, t_svi = interleaved_times([step, update], [state, svi_state], repeats)
    return t_fed, t_svi


def round_step(vfl, data):
    """One round (its keys included) as ``state -> (state, loss)``: ``update``,
    which checks the state's layout and runs the compiled round."""
    return lambda s: vfl.update(s, data)


def equal_parties_model(J, p):
    names = [f"p{j}" for j in range(J)]

    def model(y=None, **xs):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        etas = []
        for k in names:
            with nf.vertical(k):
                beta = numpyro.sample(
                    f"beta_{k}", dist.Normal(0.0, 1.0).expand([p]).to_event(1)
                )
                with numpyro.plate("rows", y.shape[0]):
                    etas.append(nf.contribution(k, xs[f"x_{k}"] @ beta))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=b + sum(etas)), obs=y)

    return model, names


def vmap_vs_loop(n, J, repeats):
    """(init s, round s) with the parties vmapped and looped."""
    model, names = equal_parties_model(J, 2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 2 * J))
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-x @ rng.normal(size=2 * J)))).astype(
        float
    )
    data = nf.VerticalData(
        {
            k: {f"x_{k}": jnp.asarray(x[:, 2 * j : 2 * j + 2])}
            for j, k in enumerate(names)
        },
        {"y": jnp.asarray(y)},
    )
    out = {}
    for vmap in (True, False):
        vfl = nf.VerticalSFVI(
            nf.augment(model, 1.0),
            nf.VerticalFamily(aux="amortized"),
            optax.adam(1e-2),
            vmap_parties=vmap,
        )
        t0 = time.perf_counter()
        state = vfl.init(jax.random.key(0), data)  # traces, probes, compiles, 1 round
        t_init = time.perf_counter() - t0
        (t_round,) = interleaved_times([round_step(vfl, data)], [state], repeats)
        out[vmap] = (t_init, t_round)
        assert len(vfl.party_groups) == (1 if vmap else J)
    return out


def state_size(n, aux):
    data = make_data(n)
    vfl = nf.VerticalSFVI(
        nf.augment(model, 1.0), nf.VerticalFamily(aux=aux), optax.adam(1e-2)
    )
    vfl.setup(data)
    return sum(
        int(np.size(x))
        for p in ("a", "b")
        for x in jax.tree.leaves(vfl.family.init(p, jax.random.key(0)))
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--out",
        default=str(pathlib.Path(__file__).parent / "results" / "vertical_round.json"),
    )
    args = parser.parse_args()
    rows = []
    print(f"{'n':>6} {'aux':>10} {'round ms':>9} {'SVI step ms':>12} {'ratio':>6}")
    for n in (500, 5000):
        for aux in ("amortized", "meanfield"):
            t_fed, t_svi = round_vs_svi(n, aux, args.repeats)
            rows.append(
                {
                    "n": n,
                    "aux": aux,
                    "round_s": t_fed,
                    "svi_step_s": t_svi,
                    "ratio": t_fed / t_svi,
                }
            )
            print(
                f"{n:>6} {aux:>10} {1e3 * t_fed:9.3f} {1e3 * t_svi:12.3f} {t_fed / t_svi:6.2f}"
            )
    sizes = []
    print(f"\n{'n':>7} {'amortized params':>17} {'mean-field params':>18}")
    for n in (500, 5000, 50000):
        a, m = state_size(n, "amortized"), state_size(n, "meanfield")
        sizes.append({"n": n, "amortized": a, "meanfield": m})
        print(f"{n:>7} {a:>17} {m:>18}")
    J, n = 10, 500
    res = vmap_vs_loop(n, J, args.repeats)
    (i_v, r_v), (i_l, r_l) = res[True], res[False]
    print(
        f"\nJ = {J} equal parties, n = {n}: {'init s':>7} {'round ms':>9}\n"
        f"{'vmapped':>26} {i_v:7.1f} {1e3 * r_v:9.3f}\n"
        f"{'looped':>26} {i_l:7.1f} {1e3 * r_l:9.3f}\n"
        f"{'ratio vmapped/looped':>26} {i_v / i_l:7.2f} {r_v / r_l:9.2f}"
    )
    out = {
        "benchmark": "vertical_round",
        "machine": platform.platform(),
        "jax": jax.__version__,
        "repeats": args.repeats,
        "round_vs_svi": rows,
        "parameters_vs_n": sizes,
        "vmapped_vs_looped_parties": {
            "J": J,
            "n": n,
            "vmapped": {"init_s": i_v, "round_s": r_v},
            "looped": {"init_s": i_l, "round_s": r_l},
            "round_ratio": r_v / r_l,
            "init_ratio": i_v / i_l,
        },
    }
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
