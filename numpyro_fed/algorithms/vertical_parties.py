# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Parties with equal blocks run as one vmapped call in the simulation runtime.

Two parties can share one compiled function when they run the same code on inputs of
the same shapes, up to names: party ``p`` then runs the function of its group's
*lead* with its state read in the lead's layout (leaf for leaf), its arrays under
the lead's array names and the two party names swapped wherever a dict is keyed by
party. Equal shapes do not prove equal code (two blocks may differ only in a prior's
scale), so every candidate is probed once: its ELBO term and auxiliary, evaluated
natively and through the lead's function at a random point, must agree; a party
that fails the probe keeps its own function (the loop).
"""

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PartyGroup", "find_groups", "run_parties"]


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
    probe = jax.jit(party_elbo, static_argnums=0)
    by_sig: dict = {}
    for p in parties:
        by_sig.setdefault(signatures[p], []).append(p)
    groups = []
    for members in by_sig.values():
        lead, ok, renames = members[0], [members[0]], {members[0]: ({}, {})}
        for i, p in enumerate(members[1:]):
            k1, k2 = jax.random.split(jax.random.fold_in(key, i))
            leaves, tree = jax.tree.flatten(raws[p])
            ks = jax.random.split(k1, len(leaves))
            raw = jax.tree.unflatten(
                tree,
                [
                    x + 0.3 * jax.random.normal(k, jnp.shape(x))
                    for x, k in zip(leaves, ks, strict=True)
                ],
            )
            mapping = _renaming(p, lead, held)
            native = probe(p, raw, views[p], k2, idx, {})
            mapped = probe(
                lead,
                as_layout(raws[lead], raw),
                rename(views[p], mapping[1]),
                k2,
                idx,
                {},
            )
            if _agree(native, mapped):
                ok.append(p)
                renames[p] = mapping
            else:
                groups.append(PartyGroup(p, (p,), {p: ({}, {})}))
        groups.append(PartyGroup(lead, tuple(ok), renames))
    return tuple(sorted(groups, key=lambda g: g.lead))


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
