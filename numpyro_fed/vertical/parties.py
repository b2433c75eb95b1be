# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Which parties can run as one vmapped call (:func:`find_groups`): the layout that
:class:`~numpyro_fed.infer.vertical.VerticalSFVI` hands to the grouped runtime.

Two parties can share one compiled function when they run the same code on inputs of
the same shapes, up to names: party ``p`` then runs the function of its group's
*lead* with its state read in the lead's layout (leaf for leaf), its arrays under
the lead's array names and the two party names swapped wherever a dict is keyed by
party. Equal shapes do not prove equal code (two blocks may differ only in a prior's
scale), so every candidate is probed once: its ELBO term and auxiliary, evaluated
natively and through the lead's function at a random point, must agree; a party
that fails the probe keeps its own function (the loop).
"""

from typing import Any, Callable, NamedTuple, overload

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "PartyGroup",
    "as_layout",
    "find_groups",
    "groups_from_slots",
    "lay_out",
    "own_layouts",
    "rename",
    "signature",
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


@overload
def rename(d: dict, mapping: dict) -> dict: ...


@overload
def rename(d: None, mapping: dict) -> None: ...


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
        ok = [lead]
        renames: dict = {lead: ({}, {})}
        for p in rest:
            if same[p] is None:
                groups.append(PartyGroup(p, (p,), {p: ({}, {})}))
            else:
                ok.append(p)
                renames[p] = same[p]
        groups.append(PartyGroup(lead, tuple(ok), renames))
    return tuple(sorted(groups, key=lambda g: g.lead))


def groups_from_slots(
    parties: tuple, stacked: Any, held: dict
) -> tuple[PartyGroup, ...] | None:
    """
    The groups a laid-out state was stacked in, read from its parties' ``slots``
    (one ``(n, J)`` array per stacked group, in the state's order): the lead's row
    is the identity and each other member's swaps its index with the lead's; the
    groups of one party fill the remaining parties in order, as :func:`find_groups`
    sorts them. ``None`` if the slots match no such layout of ``parties``.

    :param tuple parties: the party names (sorted, as the structure keeps them).
    :param stacked: the state's silos: one stacked state per group.
    :param dict held: party -> sorted names of the arrays it holds.
    :return: the groups (singletons included), or ``None``.
    """
    num = len(parties)
    identity = np.arange(num)
    leads: list = []
    for group in stacked if isinstance(stacked, tuple) else ():
        rows = np.asarray(getattr(group, "slots", None))
        if rows.ndim != 2 or rows.shape[1] != num or (rows[0] != identity).any():
            return None
        moved = [np.flatnonzero(r != identity) for r in rows[1:]]
        if any(len(m) != 2 for m in moved):
            return None
        lead = min((int(m[0]) for m in moved), default=None)
        members = [lead] + [int(m[m != lead][0]) for m in moved]
        if lead is not None and any(lead not in m for m in moved):
            return None
        leads.append(members)
    taken = {j for m in leads if m[0] is not None for j in m}
    alone = iter(j for j in range(num) if j not in taken)
    groups = []
    for found in leads:
        # [None]: a stacked group of one, whose party is the next one left alone
        first = found[0] if found[0] is not None else next(alone, None)
        if first is None:
            return None
        slots: list[int] = [first, *found[1:]]
        lead = parties[first]
        renames: dict = {lead: ({}, {})}
        renames.update(
            {parties[j]: _renaming(parties[j], lead, held) for j in slots[1:]}
        )
        groups.append(PartyGroup(lead, tuple(parties[j] for j in slots), renames))
    if next(alone, None) is not None or [g.lead for g in groups] != sorted(
        g.lead for g in groups
    ):
        return None
    return tuple(groups)


def lay_out(parties: tuple, groups: tuple | None, states: dict) -> list:
    """
    Each party's state (a ``NamedTuple`` with ``raw``, ``opt_state`` and ``slots``,
    each party's in its own layout) in its group lead's layout, with its ``slots``:
    ready to stack by group.

    :param tuple parties: the party names.
    :param groups: the :class:`PartyGroup` s (``None``: every party alone).
    :param dict states: party -> its state.
    :return: the laid-out states, in ``parties`` order.
    """
    lead_of = {p: (g.lead, g.renames[p][0]) for g in groups or () for p in g.parties}
    laid = []
    for p in parties:
        lead, names = lead_of.get(p, (p, {}))
        order = [parties.index(names.get(k, k)) for k in parties]
        s = states[p]
        laid.append(
            s._replace(
                raw=as_layout(states[lead].raw, s.raw),
                opt_state=as_layout(states[lead].opt_state, s.opt_state),
                slots=jnp.asarray(order, jnp.int32),
            )
        )
    return laid


def own_layouts(parties: tuple, laid: list, trees: dict) -> dict:
    """The inverse of :func:`lay_out`: party -> its state in its own layout
    (``trees``: party -> its state's tree structure), with identity slots."""
    out = {}
    for p, s in zip(parties, laid, strict=True):
        own = jax.tree.unflatten(trees[p], jax.tree.leaves(s))
        out[p] = own._replace(slots=jnp.arange(len(parties), dtype=jnp.int32))
    return out


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
