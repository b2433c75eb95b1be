# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: ProdLDA across 3 silos with amortized topic proportions
================================================================

Hassan et al., §4.2 (Figure 2, on 20 Newsgroups; no numbers given) on an offline
stand-in: a corpus drawn from a known LDA, its documents split at random into 3 equal
silos. The paper's model, with :math:`\\theta = (\\alpha, \\beta)` learned by
empirical Bayes:

.. math::

    T_t \\sim \\text{Dirichlet}(\\beta 1_V), \\quad
    W_d \\sim N(\\alpha 1_K, I), \\quad
    c_d \\sim \\text{Multinomial}(l_d, \\text{softmax}(\\eta_d)),

with :math:`\\eta_d = T W_d` as printed (``--link softmax``), or the product of experts
:math:`\\eta_d = \\log(T) W_d` (``--link log``, :math:`p(w) \\propto \\prod_t
T_{tw}^{W_{dt}}`), which lets a topic dominate a document; the printed form cannot,
since every entry of :math:`T` is at most 1. The topics :math:`T` are global (a
diagonal Gaussian in stick-breaking coordinates); each document's :math:`W_d` is a
local latent whose Gaussian factor an encoder network computes from the document's
word frequencies (:class:`~numpyro_fed.AutoAmortized`, one private encoder per silo,
so nothing about a silo's documents leaves it). SFVI, SFVI-Avg and independent
per-silo fits get the same budget of local steps. Reported: the ELBO trace (the same
evaluation draws for every method), UMass coherence of every topic's top words on the
pooled corpus (Mimno et al. 2011), and how well the fitted topics match the true ones.
The paper's claims: SFVI and SFVI-Avg beat the independent fits in coherence,
SFVI-Avg has higher coherence than SFVI, and SFVI reaches a higher ELBO.

Run: ``python examples/prodlda.py`` (a few minutes on 2 CPU cores); pass
``--newsgroups PATH`` to fit 20 Newsgroups from a local copy of
``20news-bydate.tar.gz`` instead (no download); ``--quick`` for a smoke run (60
documents of 50 words, 3 topics, 60 local steps).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
import optax
from scipy.optimize import linear_sum_assignment

import numpyro_fed as nf


def model(counts, num_topics=10, link="softmax"):
    num_words = counts.shape[-1]
    alpha = numpyro.param("alpha", 0.0, constraint=constraints.real)
    beta = numpyro.param("beta", 0.5, constraint=constraints.positive)
    topics = numpyro.sample(
        "T",
        dist.Dirichlet(beta * jnp.ones(num_words)).expand([num_topics]).to_event(1),
    )  # (K, V)
    with numpyro.plate("doc", counts.shape[0]):
        w = numpyro.sample(
            "W", dist.Normal(alpha, 1.0).expand([num_topics]).to_event(1)
        )  # (D, K)
        basis = topics if link == "softmax" else jnp.log(topics)
        numpyro.sample(
            "c",
            dist.Multinomial(total_count=counts.sum(-1), logits=w @ basis),
            obs=counts,
        )


def word_frequencies(arrays):
    counts = arrays["counts"]
    return counts / jnp.maximum(counts.sum(-1, keepdims=True), 1)


def synthetic_lda(num_docs, num_words, num_topics, seed=0):
    """Counts ``(num_docs, num_words)`` from LDA with sparse topics, and the topics."""
    rng = np.random.default_rng(seed)
    topics = rng.dirichlet(np.full(num_words, 0.05), size=num_topics)
    proportions = rng.dirichlet(np.full(num_topics, 0.2), size=num_docs)
    lengths = rng.poisson(60, num_docs) + 20
    counts = np.stack(
        [
            rng.multinomial(n, p)
            for n, p in zip(lengths, proportions @ topics, strict=True)
        ]
    )
    return counts.astype(np.float64), topics


def umass_coherence(topics, counts, top=10):
    """UMass coherence of each topic's ``top`` words (Mimno et al. 2011) with
    document co-occurrence counts from ``counts``:
    :math:`\\sum_{i > j} \\log ((D(w_i, w_j) + 1) / D(w_j))`, words by rank."""
    present = (np.asarray(counts) > 0).astype(np.float64)
    together = present.T @ present  # D(w_i, w_j); the diagonal is D(w)
    scores = []
    for topic in np.asarray(topics):
        words = np.argsort(-topic)[:top]
        score = 0.0
        for i in range(1, len(words)):
            for j in range(i):
                a, b = words[i], words[j]
                score += np.log((together[a, b] + 1.0) / max(together[b, b], 1.0))
        scores.append(score)
    return np.array(scores)


def topic_recovery(fitted, true):
    """Mean cosine similarity of fitted and true topics, optimally matched."""
    f = fitted / np.linalg.norm(fitted, axis=1, keepdims=True)
    t = true / np.linalg.norm(true, axis=1, keepdims=True)
    sim = f @ t.T
    rows, cols = linear_sum_assignment(-sim)
    return float(sim[rows, cols].mean())


def topics_of(guide, params, num_draws=200):
    """The posterior mean of the topics under q, by Monte Carlo (the topics at the
    mean of q's unconstrained coordinates can be far from it: stick-breaking sends
    leftover mass to the last words)."""
    keys = jax.random.split(jax.random.key(123), num_draws)
    draws = jax.vmap(lambda k: guide.draw_global(params.eta_global, k)[1]["T"])(keys)
    return np.asarray(draws.mean(0))


def run_with_trace(svi, data, key, num_rounds, chunks, judge):
    """Run ``num_rounds`` rounds (one compiled round, reused); the global ELBO of the
    fitted q after every ``num_rounds // chunks`` of them."""
    state = svi.init(key, data)
    step = jax.jit(svi.update)
    trace = []
    every = max(num_rounds // chunks, 1)
    for r in range(1, num_rounds + 1):
        state, _ = step(state, data)
        if r % every == 0 or r == num_rounds:
            trace.append(judge(svi.get_params(state)))
    return svi.get_params(state), np.array(trace)


def main(args):
    if args.x64:
        # float32 stick-breaking can put a topic's word probability at exactly 0,
        # where the sparse Dirichlet prior's density is infinite.
        numpyro.enable_x64()
    true_topics = None
    if args.newsgroups:
        from numpyro_fed.datasets import newsgroups20

        corpus = newsgroups20(args.newsgroups, vocab_size=args.num_words)
        counts = corpus.counts.astype(np.float64)
        vocab = corpus.vocab
    else:
        counts, true_topics = synthetic_lda(
            args.num_docs, args.num_words, args.num_topics, seed=args.seed
        )
        vocab = np.array([f"w{i}" for i in range(counts.shape[1])])
    groups = nf.data.split_iid(len(counts), 3, seed=args.seed)
    data = nf.FederatedData.from_groups(groups, counts=counts)
    print(data)
    bound = {"num_topics": args.num_topics, "link": args.link}

    def fed_model(counts):
        return model(counts, **bound)

    fed = nf.federate(fed_model, silos="doc")

    def guide(m=fed):
        return nf.AutoAmortized(
            m, features=word_frequencies, hidden=(args.hidden,), shared=False
        )

    def optim():
        # Halve the step size every third of the budget (counted in local steps,
        # which SFVI-Avg's carried-over optimizer state keeps counting across rounds).
        return optax.adam(optax.exponential_decay(args.lr, args.num_steps // 3, 0.5))

    judge = nf.SFVI(fed, guide(), optim(), num_particles=8)
    judge_state = judge.init(jax.random.key(99), data)

    @jax.jit
    def _elbo(params):
        server, silos = judge._from_params(params, data)
        return -judge.evaluate(judge_state._replace(server=server, silos=silos), data)

    def elbo(params):
        return float(_elbo(params))

    steps, m = args.num_steps, args.num_steps // args.avg_rounds
    fits, traces, times = {}, {}, {}
    for name, svi, rounds in (
        ("SFVI", nf.SFVI(fed, guide(), optim()), steps),
        (
            f"SFVI-Avg({m})x{args.avg_rounds}",
            nf.SFVIAvg(fed, guide(), optim(), local_steps=m),
            args.avg_rounds,
        ),
    ):
        start = time.perf_counter()
        fits[name], traces[name] = run_with_trace(
            svi, data, jax.random.key(args.seed), rounds, args.chunks, elbo
        )
        times[name] = time.perf_counter() - start
        print(f"{name}: {times[name]:.0f} s, ELBO trace {np.round(traces[name], 1)}")
        fits[name] = topics_of(svi.guide, fits[name])

    start = time.perf_counter()
    independent = nf.baselines.fit_independent(
        fed, guide, optim(), data, jax.random.key(args.seed), steps
    )
    times["independent"] = time.perf_counter() - start
    for j, f in enumerate(independent):
        fits[f"silo {j} alone"] = topics_of(f.svi.guide, f.params)
    # Each silo alone fits its own model: its own ELBO, on its own documents only.
    own = [-float(np.mean(f.result.losses[-50:])) for f in independent]
    print(
        f"independent: {times['independent']:.0f} s, final per-silo ELBOs "
        f"{np.round(own, 1)} (each on its own documents)"
    )

    rows = {}
    if true_topics is not None:
        rows["true topics"] = (
            umass_coherence(true_topics, counts, args.top_words),
            1.0,
        )
    for name, topics in fits.items():
        recovery = None if true_topics is None else topic_recovery(topics, true_topics)
        rows[name] = (umass_coherence(topics, counts, args.top_words), recovery)
    alone = [v for k, v in rows.items() if k.startswith("silo ")]
    rows["independent (3 silos)"] = (
        np.concatenate([c for c, _ in alone]),
        None if true_topics is None else float(np.mean([r for _, r in alone])),
    )

    print(
        f"\n{len(counts)} documents, {counts.shape[1]} words, {args.num_topics} topics, "
        f"link {args.link}, {steps} local steps, Adam {args.lr} halved every "
        f"{steps // 3}; UMass coherence of "
        f"the top {args.top_words} words on the pooled corpus (higher is better)"
    )
    print(
        f"{'method':>26} {'mean':>7} {'median':>7} {'q25':>7} {'q75':>7} "
        f"{'recovery':>8} {'final ELBO':>11}"
    )
    for name, (coherence, recovery) in rows.items():
        final = f"{traces[name][-1]:11.1f}" if name in traces else f"{'-':>11}"
        rec = "-" if recovery is None else f"{recovery:.3f}"
        q25, med, q75 = np.percentile(coherence, [25, 50, 75])
        print(
            f"{name:>26} {coherence.mean():7.1f} {med:7.1f} {q25:7.1f} {q75:7.1f} "
            f"{rec:>8} {final}"
        )
    print("recovery: mean cosine similarity to the true topics, optimally matched.")
    for name, topics in list(fits.items())[:2]:
        print(f"\n{name}, top words of the first 3 topics:")
        for t in topics[:3]:
            print("   ", " ".join(vocab[np.argsort(-t)[: args.top_words]]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--num-docs", type=int, default=600)
    parser.add_argument("--num-words", type=int, default=300)
    parser.add_argument("--num-topics", type=int, default=10)
    parser.add_argument("--link", choices=["softmax", "log"], default="softmax")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=3000)
    parser.add_argument("--avg-rounds", type=int, default=30)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--top-words", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--newsgroups", default=None)
    parser.add_argument(
        "--x64", action=argparse.BooleanOptionalAction, default=True, help="float64"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_docs, args.num_words, args.num_topics, args.hidden = 60, 50, 3, 16
        args.num_steps, args.avg_rounds, args.chunks, args.top_words = 60, 3, 2, 5
    main(args)
