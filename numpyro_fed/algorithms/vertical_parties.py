# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""How the runtimes drive the parties in a round (:func:`drive_round`); parties
with equal blocks run as one vmapped call in the simulation runtime.

Two parties can share one compiled function when they run the same code on inputs of
the same shapes, up to names: party ``p`` then runs the function of its group's
*lead* with its state read in the lead's layout (leaf for leaf), its arrays under
the lead's array names and the two party names swapped wherever a dict is keyed by
party. Equal shapes do not prove equal code (two blocks may differ only in a prior's
scale), so every candidate is probed once: its ELBO term and auxiliary, evaluated
natively and through the lead's function at a random point, must agree; a party
that fails the probe keeps its own function (the loop).
"""

from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.algorithms.vertical_protocol import RowIndexMismatchError
from numpyro_fed.vertical.structure import SERVER

__all__ = [
    "PartyGroup",
    "checked",
    "drive_round",
    "find_groups",
    "row_errors",
    "run_parties",
]


class PartyGroup(NamedTuple):
    """- **lead** - the party whose function the group runs.
    - **parties** - the group's parties (the lead first).
    - **renames** - party -> ``(party names, array names)``: the two involutive
      renamings ``{name: name}`` that map the party's names to the lead's (empty for
      the lead)."""

    lead: str
    parties: tuple
    renames: dict


def rename(d: dict | None, mapping: dict) -> dict | None:
    """``d`` with its keys renamed by ``mapping`` (keys not in it are kept)."""
    if d is None:
        return None
    return {mapping.get(k, k): v for k, v in d.items()}


def as_layout(template: Any, tree: Any) -> Any:
    """The leaves of ``tree`` in the tree structure of ``template``."""
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(tree))


def _leaf_sig(tree: Any) -> tuple:
    return tuple((jnp.shape(x), str(jnp.result_type(x))) for x in jax.tree.leaves(tree))


def signature(raw: dict, opt_state: Any, arrays: list, extra: tuple) -> tuple:
    """What two parties must share to be grouped: their parameters' and optimizer
    states' leaf shapes, their layout (up to site names), the shapes of the arrays
    they hold, and ``extra`` (their optimizer, rho, auxiliary shape)."""
    named = {k: v for k, v in raw.items() if k != "param"}
    return (
        _leaf_sig(raw),
        jax.tree.structure(named),
        len(raw.get("param", {})),
        _leaf_sig(opt_state),
        tuple((tuple(a.shape), str(a.dtype)) for a in arrays),
        extra,
    )


def _renaming(party: str, lead: str, held: dict) -> tuple[dict, dict]:
    arrays = {}
    for a, b in zip(held[party], held[lead], strict=True):
        arrays[a], arrays[b] = b, a
    return {party: lead, lead: party}, arrays


def find_groups(
    party_elbo: Callable,
    parties: tuple,
    signatures: dict,
    held: dict,
    views: dict,
    raws: dict,
    key: jax.Array,
    idx: Any,
) -> tuple[PartyGroup, ...]:
    """
    Group the parties whose signatures agree and whose code the probe finds equal.

    :param callable party_elbo: ``(party, raw, view, key, idx, extra) -> (z, elbo)``.
    :param tuple parties: the party names.
    :param dict signatures: party -> :func:`signature`.
    :param dict held: party -> sorted names of the arrays it holds.
    :param dict views: party -> its view of the data.
    :param dict raws: party -> its raw parameters.
    :param jax.random.key key: for the probe's random point.
    :param idx: a round's row indices (or ``None``).
    :return: the groups, singletons included, ordered by lead.
    """
    by_sig: dict = {}
    for p in parties:
        by_sig.setdefault(signatures[p], []).append(p)
    groups = []
    for members in by_sig.values():
        lead, rest = members[0], members[1:]
        same = (
            _probe(party_elbo, lead, rest, held, views, raws, key, idx) if rest else {}
        )
        ok, renames = [lead], {lead: ({}, {})}
        for p in rest:
            if same[p] is None:
                groups.append(PartyGroup(p, (p,), {p: ({}, {})}))
            else:
                ok.append(p)
                renames[p] = same[p]
        groups.append(PartyGroup(lead, tuple(ok), renames))
    return tuple(sorted(groups, key=lambda g: g.lead))


def _probe(party_elbo, lead, rest, held, views, raws, key, idx) -> dict:
    """Party -> its renamings if the lead's function reproduces its ELBO term and
    auxiliary at a random point, else ``None``. One compile for the parties' own
    functions, one for the lead's (vmapped)."""
    points, mappings = {}, {}
    for i, p in enumerate(rest):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        leaves, tree = jax.tree.flatten(raws[p])
        ks = jax.random.split(k1, len(leaves))
        noise = [
            jax.random.normal(k, jnp.shape(x)) for x, k in zip(leaves, ks, strict=True)
        ]
        raw = jax.tree.unflatten(
            tree, [x + 0.3 * e for x, e in zip(leaves, noise, strict=True)]
        )
        points[p] = (raw, k2)
        mappings[p] = _renaming(p, lead, held)

    @jax.jit
    def own(points, views):
        return {
            p: party_elbo(p, raw, views[p], k, idx, {})
            for p, (raw, k) in points.items()
        }

    @jax.jit
    @jax.vmap
    def as_lead(raw, view, k):
        return party_elbo(lead, raw, view, k, idx, {})

    inputs = [
        (
            as_layout(raws[lead], points[p][0]),
            rename(views[p], mappings[p][1]),
            points[p][1],
        )
        for p in rest
    ]
    mapped = as_lead(*jax.tree.map(lambda *xs: jnp.stack(xs), *inputs))
    native = own(points, {p: views[p] for p in rest})
    return {
        p: mappings[p]
        if _agree(native[p], jax.tree.map(lambda x, i=i: x[i], mapped))
        else None
        for i, p in enumerate(rest)
    }


def _agree(a: Any, b: Any) -> bool:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if not (np.all(np.isfinite(x)) and np.allclose(x, y, rtol=1e-10, atol=1e-12)):
            return False
    return True


def run_parties(
    fn: Callable,
    groups: tuple[PartyGroup, ...],
    args: dict,
    into: Callable,
    back: Callable,
) -> dict:
    """
    ``fn(party, *args[party])`` for every party: a singleton group calls its own
    function, a larger one calls its lead's function once, vmapped over its parties'
    stacked inputs.

    :param callable fn: a party function with the party name first.
    :param tuple groups: from :func:`find_groups`.
    :param dict args: party -> tuple of its arguments.
    :param callable into: ``(group, party, args) -> args`` in the lead's layout.
    :param callable back: ``(group, party, output) -> output`` in the party's layout.
    :return: party -> output.
    """
    out = {}
    for g in groups:
        if len(g.parties) == 1:
            out[g.lead] = fn(g.lead, *args[g.lead])
            continue
        mapped = [into(g, p, args[p]) for p in g.parties]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *mapped)
        result = jax.vmap(partial(fn, g.lead))(*stacked)
        for i, p in enumerate(g.parties):
            out[p] = back(g, p, jax.tree.map(lambda x, i=i: x[i], result))
    return out


def drive_round(
    alg: Any,
    structure: Any,
    server_state: Any,
    ps: dict,
    views: dict,
    r: Any,
    groups: tuple[PartyGroup, ...] | None,
    log: Callable,
) -> tuple[Any, dict, jax.Array, dict]:
    """
    One round of the protocol ``alg`` (a ``VerticalAlgorithm``): Algorithm 1 for
    ``structure.kind == "augmented"``, Algorithm 2 otherwise.

    :param alg: the round's functions (jitted or not).
    :param structure: the model's ``VerticalStructure``.
    :param server_state: the server's state.
    :param dict ps: party -> its state.
    :param dict views: owner -> its view of the data.
    :param r: the round's row indices and keys (``round_keys``).
    :param tuple groups: from :func:`find_groups` (``None``: one party at a time).
    :param callable log: ``(sender, {party: message})``, called with every message.
    :return: ``(server state, {party: state}, loss, {owner: ELBO term})``.
    """
    parties = structure.parties
    if groups is None:
        groups = tuple(PartyGroup(p, (p,), {p: ({}, {})}) for p in parties)

    def state_in(g, p, s):
        return as_layout(ps[g.lead], s)

    def view_in(g, p, v):
        return rename(v, g.renames[p][1])

    def broadcast_in(g, p, b):
        return None if b is None else b._replace(z=rename(b.z, g.renames[p][0]))

    msgs = run_parties(
        alg.party_send,
        groups,
        {p: (ps[p], views[p], r.party_keys[p], r.party_idx[p]) for p in parties},
        lambda g, p, a: (state_in(g, p, a[0]), view_in(g, p, a[1]), *a[2:]),
        lambda g, p, out: out,
    )
    log("party", msgs)
    broadcast = None
    if structure.kind == "augmented":
        server, grads, server_elbo = alg.server_step(
            server_state, msgs, views[SERVER], r.server_key, r.idx
        )
    else:
        broadcast = alg.server_broadcast(server_state, msgs, r.server_key, r.idx)
        log("server", {p: broadcast for p in parties})
        cross = run_parties(
            alg.party_cross,
            groups,
            {
                p: (ps[p], views[p], r.party_keys[p], r.party_idx[p], broadcast)
                for p in parties
            },
            lambda g, p, a: (
                state_in(g, p, a[0]),
                view_in(g, p, a[1]),
                *a[2:4],
                broadcast_in(g, p, a[4]),
            ),
            lambda g, p, out: out._replace(z=rename(out.z, g.renames[p][0])),
        )
        log("party", cross)
        server, grads, server_elbo = alg.server_collect(
            server_state, views[SERVER], r.server_key, r.idx, broadcast, cross
        )
    log("server", grads)
    updated = run_parties(
        alg.party_update,
        groups,
        {
            p: (
                ps[p],
                views[p],
                r.party_keys[p],
                r.party_idx[p],
                grads[p],
                broadcast,
            )
            for p in parties
        },
        lambda g, p, a: (
            state_in(g, p, a[0]),
            view_in(g, p, a[1]),
            *a[2:5],
            broadcast_in(g, p, a[5]),
        ),
        lambda g, p, out: (as_layout(ps[p], out[0]), out[1]),
    )
    new = {p: updated[p][0] for p in parties}
    elbos = {p: updated[p][1] for p in parties}
    loss = -(server_elbo + sum(elbos[p] for p in parties))
    info = {SERVER: server_elbo, **elbos}
    return server, new, loss, info


@contextmanager
def row_errors():
    """Re-raise a row-index mismatch that the server detected inside a compiled round
    (a host callback's error) as :class:`RowIndexMismatchError`."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        text = str(err)
        tag = "RowIndexMismatchError: "
        if tag not in text:
            raise
        raise RowIndexMismatchError(
            text[text.rindex(tag) + len(tag) :].splitlines()[0]
        ) from None


def checked(step: Callable) -> Callable:
    """``step`` run to completion under :func:`row_errors`."""

    def call(state):
        if isinstance(state.rng_key, jax.core.Tracer):  # traced (run's lax.scan)
            return step(state)
        with row_errors():
            return jax.block_until_ready(step(state))

    return call
