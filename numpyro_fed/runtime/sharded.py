# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Sharded runtime: the silos spread over the devices of a mesh.

The silos' states, data, keys and routed messages are split along the mesh axis
``"silos"`` with :func:`jax.shard_map`; each device steps its own block of silos
under :func:`jax.vmap`, and the replies are gathered to every device, where the
server side (``select``, ``server_message``, ``server_step``) runs replicated. The
result is :func:`~numpyro_fed.runtime.simulate.simulate_round`'s, to float
tolerance. It works for any :class:`~numpyro_fed.FederatedAlgorithm`; silos of
different structure, in groups, go through :func:`sharded_group_round` (each device
steps its own groups)."""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData, vmap_silos
from numpyro_fed.runtime.groups import group_round, step_group, step_groups
from numpyro_fed.runtime.simulate import simulate_round
from numpyro_fed.util import zeros_like_shapes

__all__ = ["SILO_AXIS", "sharded_group_round", "sharded_round", "silo_mesh"]

#: The name of the mesh axis the silos are sharded along.
SILO_AXIS = "silos"


def silo_mesh(num_devices: int | None = None) -> Mesh:
    """
    A one-axis mesh named ``"silos"`` over the first ``num_devices`` devices.

    Its axis is ``Auto`` (``jax.make_mesh`` defaults to ``Explicit`` axes), so the
    compiler places what :func:`sharded_round` leaves unsharded.

    :param int num_devices: how many devices (default: all of ``jax.devices()``).
    :return: a :class:`jax.sharding.Mesh`.
    """
    available = len(jax.devices())
    n = available if num_devices is None else num_devices
    if not isinstance(n, int) or not 1 <= n <= available:
        raise ValueError(
            f"num_devices must be an int in [1, {available}] (the devices jax "
            f"sees), got {num_devices!r}."
        )
    return jax.make_mesh(
        (n,),
        (SILO_AXIS,),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:n],
    )


def _num_shards(mesh: Mesh) -> int:
    if SILO_AXIS not in mesh.shape:
        raise ValueError(
            f"The mesh has no axis named {SILO_AXIS!r} (its axes: "
            f"{tuple(mesh.axis_names)}); build one with silo_mesh()."
        )
    return mesh.shape[SILO_AXIS]


def _pad_rows(tree: Any, num_silos: int, padded: int) -> Any:
    """``tree``'s rows, then copies of its last row up to ``padded`` rows: inert
    silos that compute on real values (no spurious NaN) and are thrown away."""
    if padded == num_silos:
        return tree
    rows = jnp.minimum(jnp.arange(padded), num_silos - 1)
    return jax.tree.map(lambda x: x[rows], tree)


def sharded_round(
    algorithm: FederatedAlgorithm,
    mesh: Mesh,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    server_key: jax.Array,
    silo_keys: jax.Array,
    participating: jax.Array | None = None,
) -> tuple[Any, Any, Any]:
    """
    One round with the silos sharded over ``mesh``'s ``"silos"`` axis.

    Pure and jit-able, with :func:`~numpyro_fed.runtime.simulate.simulate_round`'s
    contract and return value. The number of silos ``J`` need not divide the number
    of devices ``D``: the silo axis is padded to a multiple of ``D`` with inert silos
    (copies of the last one, never contacted, their rows dropped), so each device
    steps ``ceil(J / D)`` silos. Only the contacted silos keep their new state.

    The states come back replicated over the mesh. Inputs placed elsewhere (the
    first round's, on one device) make a jitted round compile a second time; to
    avoid it, put them on the mesh first:
    ``jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))``.

    **Example:**

    .. doctest::

        >>> from functools import partial
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData
        >>> from numpyro_fed.runtime import sharded_round, silo_mesh, simulate_round
        >>> algorithm = FederatedAlgorithm(  # each silo replies its data's sum
        ...     init_server=lambda key: jnp.zeros(()),
        ...     init_silo=lambda key, data: jnp.zeros(()),
        ...     server_message=lambda s, key: Message(s),
        ...     silo_step=lambda m, s, d, key: (jnp.sum(d.arrays["y"]), s + 1),
        ...     server_step=lambda s, r, key, p: (s + jnp.sum(jnp.where(p, r, 0)), r),
        ... )
        >>> data = SiloData(  # 3 silos of 4 units
        ...     {"y": jnp.arange(12.0).reshape(3, 4)},
        ...     jnp.ones((3, 4), bool),
        ...     jnp.arange(12).reshape(3, 4),
        ... )
        >>> keys = jax.random.split(jax.random.key(1), 3)
        >>> args = (jnp.zeros(()), jnp.zeros(3), data, jax.random.key(0), keys)
        >>> round_fn = jax.jit(partial(sharded_round, algorithm, silo_mesh()))
        >>> server, silos, _ = round_fn(*args)
        >>> print(server, silos)
        66.0 [1. 1. 1.]
        >>> bool(server == simulate_round(algorithm, *args)[0])
        True

    Takes and returns what :func:`~numpyro_fed.runtime.simulate.simulate_round`
    does, with the mesh after the algorithm.

    :param jax.sharding.Mesh mesh: a mesh with an axis named ``"silos"``
        (:func:`silo_mesh`); other axes are not used.
    """
    _num_shards(mesh)  # a mesh without a "silos" axis is refused before any work
    return simulate_round(
        algorithm,
        server_state,
        silo_states,
        silo_data,
        server_key,
        silo_keys,
        participating,
        step_silos=partial(_sharded_silos, mesh),
    )


def _sharded_silos(mesh: Mesh, silo_step, message: Message, states, data, keys):
    """:func:`~numpyro_fed.runtime.simulate.vmap_silos` with the silos split over
    the mesh axis (padded with inert copies to a multiple of the device count)."""
    num_silos = data.mask.shape[0]
    shards = _num_shards(mesh)
    padded = -(-num_silos // shards) * shards

    def silo_side(broadcast, routed, states, data, keys):
        replies, states = vmap_silos(
            silo_step, Message(broadcast, routed), states, data, keys
        )
        # Every device gets every reply: the server side runs replicated.
        replies = jax.lax.all_gather(replies, SILO_AXIS, tiled=True)
        return replies, states

    silos, whole = PartitionSpec(SILO_AXIS), PartitionSpec()
    # check_vma=False: an algorithm's own scans start from constants (invariant
    # across devices) and carry per-silo values; it knows nothing of the mesh.
    replies, new_states = jax.shard_map(
        silo_side,
        mesh=mesh,
        in_specs=(whole, silos, silos, silos, silos),
        out_specs=(whole, silos),
        check_vma=False,
    )(
        message.broadcast,
        *_pad_rows((message.routed, states, data, keys), num_silos, padded),
    )
    return jax.tree.map(lambda x: x[:num_silos], (replies, new_states))


def sharded_group_round(
    algorithm: FederatedAlgorithm,
    mesh: Mesh,
    groups: tuple,
    server_state: Any,
    silo_states: tuple,
    silo_data: tuple,
    server_key: jax.Array,
    silo_keys: tuple,
    participating: jax.Array | None = None,
) -> tuple[Any, tuple, Any]:
    """
    One round over silos in groups of equal structure, the groups spread over
    ``mesh``'s ``"silos"`` axis: :func:`~numpyro_fed.runtime.groups.group_round`'s
    contract and return value, with the mesh after the algorithm.

    Group ``g`` is stepped on device ``g mod D`` only (as in ``group_round``: a
    group of one called as it is, a larger one vmapped); silos of different
    structure cannot share one SPMD program, so each device runs its own branch of
    a :func:`jax.lax.switch` on its mesh index, with every input replicated, and
    each group's replies and states are then read from the device that owns it. The
    server side runs replicated. Fewer groups than devices leave devices idle.

    :param jax.sharding.Mesh mesh: a mesh with an axis named ``"silos"``
        (:func:`silo_mesh`); other axes are not used.
    """
    _num_shards(mesh)  # a mesh without a "silos" axis is refused before any work
    return group_round(
        algorithm,
        groups,
        server_state,
        silo_states,
        silo_data,
        server_key,
        silo_keys,
        participating,
        step_silos=partial(_sharded_groups, mesh),
    )


def _sharded_groups(mesh: Mesh, silo_step, broadcast, routed, states, data, keys):
    """:func:`~numpyro_fed.runtime.groups.step_groups` with group ``g`` stepped on
    device ``g mod D`` only."""
    shards = _num_shards(mesh)
    owner = [g % shards for g in range(len(states))]
    args = (broadcast, routed, states, data, keys)
    # what a device returns for a group it does not own: zeros for the replies
    # (read from the owner, never from here) and the states as they came
    replies_shape = jax.eval_shape(lambda *a: step_groups(silo_step, *a)[0], *args)

    def branch(device: int):
        def run(broadcast, routed, states, data, keys):
            replies, new = [], []
            for g, owned in enumerate(owner):
                if owned == device:
                    reply, state = step_group(
                        silo_step, broadcast, routed[g], states[g], data[g], keys[g]
                    )
                else:
                    reply, state = zeros_like_shapes(replies_shape[g]), states[g]
                replies.append(reply)
                new.append(state)
            # a leading device axis: row d is device d's
            return jax.tree.map(lambda x: x[None], (replies, new))

        return run

    def device_side(*args):
        index = jax.lax.axis_index(SILO_AXIS)
        return jax.lax.switch(index, [branch(d) for d in range(shards)], *args)

    replies, new = jax.shard_map(
        device_side,
        mesh=mesh,
        in_specs=PartitionSpec(),
        out_specs=PartitionSpec(SILO_AXIS),
        check_vma=False,  # as _sharded_silos: the algorithm knows nothing of the mesh
    )(*args)
    pick = [lambda x, d=d: x[d] for d in owner]
    return (
        [jax.tree.map(f, r) for f, r in zip(pick, replies, strict=True)],
        [jax.tree.map(f, s) for f, s in zip(pick, new, strict=True)],
    )
