# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Flower runtime: any :class:`~numpyro_fed.FederatedAlgorithm` between a Flower
``ServerApp`` and ``ClientApp`` s on the nodes that hold the data.

The server's ``@app.main()`` loop runs :class:`~numpyro_fed.runtime.remote.RemoteServer`
(``select``, ``server_message``, ``server_step``); each node's ``train`` handler runs
:class:`~numpyro_fed.runtime.remote.RemoteSilo` (``silo_step``) on the node's own data,
keeping the silo state in ``context.state``, which never leaves the node. Messages
and replies travel as one record of the codec's flat dict (:func:`to_record`). There
is no ``Strategy`` and nothing here names an algorithm.

This is the only module that imports ``flwr``: install it with
``pip install "numpyro-fed[flower]"``.

**Example** (an app module that ``flwr run`` or :func:`flwr.simulation.run_simulation`
loads on the server and on every node)::

    fit = nf.SFVI(model, guide, optax.adam(1e-2))
    layout = ...  # a FederatedData with the silos' common layout (no real data)

    def federation(context):
        return fit.federation(layout)

    def load_silo(context):  # runs on the node: only its own data
        j = int(context.node_config["silo"])
        return j, silo_from_file(context.node_config["data"])

    server = flower.server_app(federation, num_rounds=500)
    client = flower.client_app(federation, load_silo)
"""

import logging
import os
import secrets
import time
from typing import Any, Callable, NamedTuple, TypeVar
import warnings
import zlib

import jax
import numpy as np

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "numpyro_fed.runtime.flower needs Flower: pip install 'numpyro-fed[flower]'."
    ) from error

from numpyro_fed.checks import check_count
from numpyro_fed.guard import check_rejections
from numpyro_fed.runtime.checkpoint import (
    CheckpointError,
    checkpoint_meta,
    checkpoint_steps,
    load_checkpoint,
    save_checkpoint,
)
from numpyro_fed.runtime.codec import TemplateMismatch, decode, encode, pack, unpack
from numpyro_fed.runtime.remote import Federation, RemoteServer, RemoteSilo

__all__ = ["FlowerRun", "client_app", "from_record", "serve", "server_app", "to_record"]

logger = logging.getLogger(__name__)

#: Record names inside a Flower message.
CONTENT, CONFIG, STATE, ROOT = "content", "config", "silo_state", "silo_root"
DONE = "rounds_done"
#: Fields of a packed record (:func:`to_record`).
PACKED, DATA = "fields", "data"
#: Bytes up to which :func:`to_record` packs a flat dict into one ``ConfigRecord``
#: (Flower splits an ``ArrayRecord``'s arrays into 5 MiB chunks; a record of its own
#: is not split).
PACK_LIMIT = 4 * 2**20
#: The name of a fit when an app runs only one.
DEFAULT = "fit"
#: Seconds between the server's polls for replies (``Grid.send_and_receive`` of a
#: deployed Flower 1.42 grid sleeps 3 s between polls, longer than a round takes).
POLL_INTERVAL = 0.02
#: Seconds between the server's looks for nodes that joined or left the grid, when
#: every silo has a node and replied in the last round (else it looks each round).
NODE_CHECK_INTERVAL = 1.0


def to_record(flat: dict) -> ConfigRecord | ArrayRecord:
    """
    A flat dict of arrays (:func:`~numpyro_fed.runtime.codec.encode`) as one Flower
    record; :func:`from_record` gives it back exactly (names, shapes, dtypes).

    Up to ``PACK_LIMIT`` bytes (4 MiB) it is one ``ConfigRecord`` (the fields packed
    by :func:`~numpyro_fed.runtime.codec.pack`): Flower moves a message as a tree of
    objects, one request per object and hop, and an ``ArrayRecord`` of ``n`` arrays
    is ``2 n + 1`` objects. Larger dicts are an ``ArrayRecord`` (Flower chunks it).
    """
    arrays = {name: np.asarray(x) for name, x in flat.items()}
    if sum(x.nbytes for x in arrays.values()) > PACK_LIMIT:
        return ArrayRecord({name: Array(x) for name, x in arrays.items()})
    fields, data = pack(arrays)
    return ConfigRecord({PACKED: fields, DATA: data})


def from_record(record: Any) -> dict:
    """The flat dict of arrays that :func:`to_record` made ``record`` from."""
    if isinstance(record, ArrayRecord):
        return {name: array.numpy() for name, array in record.items()}
    data, fields = record[DATA], record[PACKED]
    if not isinstance(data, bytes) or not isinstance(fields, str):
        raise TypeError(f"not a record of arrays: {type(record).__name__}.")
    return unpack(fields, data)


_R = TypeVar("_R", ArrayRecord, ConfigRecord)


def _record(records: RecordDict, key: str, kind: type[_R]) -> _R:
    """``records[key]``, checked to be a ``kind`` (a message's or the node state's)."""
    record = records[key]
    if not isinstance(record, kind):
        raise TypeError(
            f"record {key!r} is a {type(record).__name__}, not a {kind.__name__}."
        )
    return record


def _int(record: ConfigRecord, field: str) -> int:
    """An integer field of a config record."""
    value = record[field]
    if not isinstance(value, int):
        raise TypeError(f"config field {field!r} is {value!r}, not an integer.")
    return value


class FlowerRun(NamedTuple):
    """What :func:`serve` returns (and :func:`server_app` hands to ``on_result``).

    - **state** - the final server state.
    - **infos** - the server's info of every round run.
    - **nodes** - ``{silo: node id}`` at the end.
    - **missing** - per round, ``{silo: node id}`` of the silos contacted whose
      reply did not come (a node that failed, left or missed ``round_timeout``).
    """

    state: Any
    infos: list
    nodes: dict
    missing: list


# ------------------------------------------------------------------- server side
def serve(
    grid: Grid,
    federation: Federation,
    num_rounds: int,
    *,
    name: str = DEFAULT,
    rng_key: jax.Array | None = None,
    round_timeout: float | None = None,
    node_timeout: float = 120.0,
    on_round: Callable[[int, Any], None] | None = None,
    checkpoint_every: int | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    max_rejected: float | None = 0.25,
) -> FlowerRun:
    """
    The server loop on a Flower ``Grid``: ``num_rounds`` rounds of
    ``federation.algorithm`` with the nodes that serve its silos (for a ``ServerApp``
    of your own; :func:`server_app` is this in an app).

    Each round the server asks the nodes it has not seen which silo they serve,
    forgets nodes that left the grid, contacts the silos that ``select`` names and
    that have a node, and applies the replies that arrive within ``round_timeout``;
    a silo without a reply did not take part in that round. With
    ``federation.schedule`` a round is one pass of events (the sequential and
    asynchronous schedules): the server contacts one silo at a time in the pass's
    order, each with the message of the pass's staleness, and steps on each reply.

    :param Grid grid: the grid of ``@app.main()``.
    :param Federation federation: what every process agrees on.
    :param int num_rounds: contract rounds to run (``federation.exchanges`` of them
        make one round of the algorithm), or passes of events.
    :param str name: the fit's name, as the nodes' :func:`client_app` knows it.
    :param rng_key: the server's key (default: drawn at random).
    :param float round_timeout: seconds to wait for a round's replies (an event's
        reply, in a pass of events); a late reply is dropped. ``None`` waits for all.
    :param float node_timeout: seconds to wait for every silo's node at the start
        (an error if none came).
    :param on_round: called as ``on_round(t, info)`` after each round.
    :param int checkpoint_every: write the server state and key to
        ``checkpoint_dir`` after every this many rounds; the nodes keep their silo
        states as of the same rounds (:func:`client_app`'s ``checkpoint_dir``).
    :param str checkpoint_dir: the server's checkpoint directory.
    :param bool resume: continue from the newest checkpoint in ``checkpoint_dir``
        up to ``num_rounds`` rounds in all (``infos`` then holds the rounds run now).
    :param float max_rejected: raise :class:`~numpyro_fed.guard.SiloFailure` (with
        the run in its ``result``) at the end when a silo's replies were rejected in
        more than this fraction of the rounds it was contacted in (``None``: never).
    :return: :class:`FlowerRun`.
    :raises TemplateMismatch: a reply that does not match the reply template (names
        the silo, its node and the field; nothing of that round is applied).
    """
    num_rounds = check_count("num_rounds", num_rounds)
    server = RemoteServer(federation)
    key = jax.random.key(secrets.randbits(63)) if rng_key is None else rng_key
    num_silos = federation.num_silos
    every = _check_checkpointing(checkpoint_every, checkpoint_dir, resume)
    meta = {"fit": name, "num_silos": num_silos}
    # _check_checkpointing refuses checkpoint_every or resume without a directory,
    # so the tests of checkpoint_dir below only narrow its type.
    fresh = every is not None and not resume
    if fresh and checkpoint_dir is not None and checkpoint_steps(checkpoint_dir):
        raise CheckpointError(
            f"{checkpoint_dir} already holds checkpoints: resume=True continues "
            "that run; a new run needs an empty directory."
        )
    nodes = _find_silos(grid, name, num_silos, node_timeout, {})
    if not nodes:  # a run with no silo would "finish" having learnt nothing
        raise RuntimeError(f"No node said it serves fit {name!r} in {node_timeout} s.")
    state, key = server.init(key)
    start = 0
    if resume and checkpoint_dir is not None:
        saved, start, _ = load_checkpoint(
            checkpoint_dir, {"server": state, "rng_key": key}, expect_meta=meta
        )
        state, key = saved["server"], saved["rng_key"]
    infos: list = []
    contacted: list = []
    missing: list[dict] = []
    checked = time.monotonic()
    for t in range(start, num_rounds):
        # Asking the grid for its nodes is a request on every round's path; a node
        # that left or failed shows as a missing reply, and a new one can wait.
        lost = bool(missing and missing[-1]) or len(nodes) < num_silos
        if lost or time.monotonic() - checked >= NODE_CHECK_INTERVAL:
            nodes = _find_silos(grid, name, num_silos, 0.0, nodes)
            checked = time.monotonic()
        available = np.zeros(num_silos, bool)
        available[list(nodes)] = True
        config = {"name": name, "round": t, "start": start, "every": every or 0}
        missing.append({})

        def exchange(flat, nodes=nodes, config=config, lost=missing[-1]):
            replies = _exchange(grid, config, flat, nodes, round_timeout)
            lost.update({j: nodes[j] for j in flat if j not in replies})
            return replies

        try:
            state, key, info, contacted_t = server.round(
                state, key, available, exchange, t
            )
        except TemplateMismatch as error:
            raise TemplateMismatch(
                f"round {t}: {error} (nodes: {_named(nodes)}); nothing was applied."
            ) from None
        rejected = np.asarray(info.rejected)
        rejected = rejected.any(0) if rejected.ndim > 1 else rejected  # a pass
        _warn_rejected(t, rejected, nodes)
        infos.append(info)
        contacted.append(contacted_t)
        if checkpoint_dir is not None and every is not None and (t + 1) % every == 0:
            state_and_key = {"server": state, "rng_key": key}
            save_checkpoint(checkpoint_dir, state_and_key, step=t + 1, meta=meta)
        if on_round is not None:
            on_round(t, info)
    run = FlowerRun(state, infos, dict(nodes), missing)
    if infos:
        history = {
            "rejected": np.stack(
                [np.asarray(i.rejected).reshape(-1, num_silos).any(0) for i in infos]
            ),
            "contacted": np.stack(contacted),
        }
        labels = [f"silo {j} (node {nodes.get(j)})" for j in range(num_silos)]
        check_rejections(name, history, max_rejected, run, warn=False, labels=labels)
    return run


def _check_checkpointing(every: int | None, directory: Any, resume: bool):
    if every is not None:
        every = check_count("checkpoint_every", every)
    if (every is not None or resume) and directory is None:
        raise ValueError("checkpoint_every and resume need a checkpoint_dir.")
    return every


def server_app(
    make_federation: Callable[[Context], Federation],
    num_rounds: int,
    *,
    on_result: Callable[[FlowerRun], None] | None = None,
    **options: Any,
) -> ServerApp:
    """
    A Flower ``ServerApp`` that runs :func:`serve`.

    :param make_federation: ``context -> Federation`` (the same on every process).
    :param int num_rounds: rounds to run.
    :param on_result: called with the :class:`FlowerRun` at the end.
    :param options: ``name``, ``rng_key``, ``round_timeout``, ``node_timeout``,
        ``on_round``, as for :func:`serve`.
    """
    num_rounds = check_count("num_rounds", num_rounds)
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run = serve(grid, make_federation(context), num_rounds, **options)
        if on_result is not None:
            on_result(run)

    return app


def _named(nodes: dict) -> str:
    return ", ".join(f"silo {j} on node {n}" for j, n in sorted(nodes.items()))


def _find_silos(
    grid: Grid, name: str, num_silos: int, timeout: float, known: dict
) -> dict[int, int]:
    """``{silo: node id}``: ``known`` less the nodes that left the grid, plus the new
    nodes, asked which silo of fit ``name`` they serve; waits up to ``timeout``
    seconds until every silo has a node."""
    deadline = time.monotonic() + timeout
    while True:
        present = set(grid.get_node_ids())
        known = {j: n for j, n in known.items() if n in present}
        new = sorted(present - set(known.values()))
        if new:
            config = RecordDict({CONFIG: ConfigRecord({"name": name})})
            asks = [Message(config, dst_node_id=n, message_type="query") for n in new]
            for reply in _send_and_receive(grid, asks, max(timeout, 30.0)):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    logger.warning(
                        "node %s did not say its silo: %s", node, reply.error.reason
                    )
                    continue
                silo = _int(_record(reply.content, CONFIG, ConfigRecord), "silo")
                if not 0 <= silo < num_silos:
                    raise ValueError(
                        f"node {node} serves silo {silo} of fit {name!r}, outside "
                        f"0..{num_silos - 1}."
                    )
                if silo in known and known[silo] != node:
                    raise ValueError(
                        f"nodes {known[silo]} and {node} both serve silo {silo} of "
                        f"fit {name!r}."
                    )
                known[silo] = node
        if len(known) >= num_silos or time.monotonic() >= deadline:
            return known
        time.sleep(0.1)


def _exchange(
    grid: Grid, config: dict, flat: dict, nodes: dict, timeout: float | None
) -> dict[int, dict]:
    round_index = config["round"]
    silo_of = {node: j for j, node in nodes.items()}
    record = ConfigRecord(config)

    def content(message: dict) -> RecordDict:
        packed = to_record(message)
        if isinstance(packed, ArrayRecord):
            return RecordDict({CONTENT: packed, CONFIG: record})
        # The round's config rides in the packed record: each object of a message
        # is a request on each of its hops.
        packed.update(config)
        return RecordDict({CONTENT: packed})

    messages = [
        Message(content(message), dst_node_id=nodes[j], message_type="train")
        for j, message in flat.items()
    ]
    replies = {}
    for reply in _send_and_receive(grid, messages, timeout):
        node = reply.metadata.src_node_id
        j = silo_of.get(node)
        if j is None:
            continue
        if reply.has_error():
            failed = (round_index, j, node, reply.error.reason)
            logger.warning("round %d: silo %d (node %s) failed: %s", *failed)
            continue
        replies[j] = from_record(reply.content[CONTENT])
    missing = sorted(set(flat) - set(replies))
    if missing:
        logger.warning(
            "round %d: no reply from %s; they do not take part in it.",
            round_index,
            ", ".join(f"silo {j} (node {nodes[j]})" for j in missing),
        )
    return replies


def _send_and_receive(
    grid: Grid, messages: list, timeout: float | None
) -> list[Message]:
    """The replies to ``messages`` that arrive within ``timeout`` seconds (``None``:
    all), polled every :data:`POLL_INTERVAL` seconds."""
    waiting = set(grid.push_messages(messages))
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while waiting:
        for reply in grid.pull_messages(waiting):
            waiting.discard(reply.metadata.reply_to_message_id)
            replies.append(reply)
        if not waiting or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(POLL_INTERVAL)
    return replies


def _warn_rejected(round_index: int, rejected: np.ndarray, nodes: dict) -> None:
    silos = np.flatnonzero(rejected)
    if silos.size:
        warnings.warn(
            f"round {round_index}: the server rejected the replies of "
            + ", ".join(f"silo {j} (node {nodes.get(int(j))})" for j in silos)
            + " as not finite or not valid; the state is as if they had not taken part.",
            stacklevel=2,
        )


# ------------------------------------------------------------------- silo side
_FEDERATIONS: dict = {}
_SILOS: dict = {}


def _process_cache() -> tuple[dict, dict]:
    # The apps' handlers are closures, which Ray pickles by value with copies of the
    # globals they name; a module-level function is pickled by reference, so this
    # returns the caches of the process the handler runs in.
    return _FEDERATIONS, _SILOS


def client_app(
    make_federation: Callable[[Context], Federation] | None = None,
    load_silo: Callable[[Context], tuple[int, Any]] | None = None,
    *,
    fits: dict | None = None,
    root_key: Callable[[Context], jax.Array] | None = None,
    checkpoint_dir: Callable[[Context], str] | None = None,
) -> ClientApp:
    """
    A Flower ``ClientApp`` that runs ``silo_step`` on the node's own data.

    :param make_federation: ``context -> Federation`` (the same on every process).
    :param load_silo: ``context -> (silo index, SiloData)``: the node's own data,
        padded to the federation's layout of that silo; called once per node and
        process.
    :param dict fits: instead of the two above, ``{name: (make_federation,
        load_silo)}`` for a node that serves several fits (the server's
        :func:`serve` names the fit in each message).
    :param root_key: ``context -> key``: the silo's root key. By default each node
        draws one at random and keeps it in ``context.state`` (it is never sent).
    :param checkpoint_dir: ``context -> directory``: where the node writes its silo
        state when the server checkpoints, and reads it back when the server resumes
        from a round the node's state is not at (e.g. after a restart). The silo
        state never leaves the node, so the node keeps its own checkpoints.
    """
    if fits is None:
        if make_federation is None or load_silo is None:
            raise TypeError("client_app needs make_federation and load_silo, or fits.")
        fits = {DEFAULT: (make_federation, load_silo)}
    app = ClientApp()

    def silo_of(context: Context, name: str) -> tuple[int, RemoteSilo]:
        if name not in fits:
            raise KeyError(f"this node serves the fits {sorted(fits)}, not {name!r}.")
        # A simulation actor serves many nodes and a deployed node many messages:
        # build the federation once per run and the silo once per node, so the
        # compiled silo step is reused.
        make, load = fits[name]
        federations, silos = _process_cache()
        if (context.run_id, name) not in federations:
            federations[context.run_id, name] = make(context)
        cache_key = (context.run_id, context.node_id, name)
        if cache_key not in silos:
            index, data = load(context)
            federation = federations[context.run_id, name]
            root = _root(context, root_key, name)
            silo = RemoteSilo(federation, data, root, silo=int(index))
            silos[cache_key] = (int(index), silo)
        return silos[cache_key]

    @app.query()
    def query(message: Message, context: Context) -> Message:
        asked = _record(message.content, CONFIG, ConfigRecord)
        index, _ = silo_of(context, str(asked["name"]))
        reply = RecordDict({CONFIG: ConfigRecord({"silo": index})})
        return Message(reply, reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        # the config's own record, or the packed content (see _exchange)
        config_key = CONFIG if CONFIG in message.content else CONTENT
        received = _record(message.content, config_key, ConfigRecord)
        name = str(received["name"])
        _, silo = silo_of(context, name)
        config = {k: _int(received, k) for k in ("round", "start", "every")}
        t, start, every = config["round"], config["start"], config["every"]
        directory = None
        if checkpoint_dir is not None:  # one directory per fit
            directory = os.path.join(checkpoint_dir(context), name)
        state, done = _silo_state(context, silo, name, config, directory)
        if directory is not None and every and state is not None:
            # This state is the silo's as of every checkpoint round from `done` to
            # t: the server may resume from any of them (the newest two kept).
            rounds = [b for b in range(max(done, 1), t + 1) if b % every == 0][-2:]
            for b in rounds:
                _save_silo(directory, silo, state, b, context)
        reply, state = silo.step(from_record(message.content[CONTENT]), state, t)
        context.state[f"{name}/{STATE}"] = to_record(state)
        context.state[f"{name}/{DONE}"] = ConfigRecord(
            {"rounds": t + 1, "start": start}
        )
        if directory is not None and every and (t + 1) % every == 0:
            _save_silo(directory, silo, state, t + 1, context)
        return Message(RecordDict({CONTENT: to_record(reply)}), reply_to=message)

    return app


def _silo_state(
    context: Context, silo: RemoteSilo, name: str, config: dict, directory: Any
) -> tuple[dict | None, int]:
    """``(flat silo state, rounds done)`` to step from (``None``: a fresh silo).

    The node's own state, unless the server went back to its checkpoint of round
    ``start`` after the node had moved past it: then the node's checkpoint of that
    round. A node without a state (its first contact, or it restarted) takes its
    newest checkpoint of this run, or of round ``start`` in a resumed run; without
    any, the silo had not stepped by then and starts fresh."""
    start = config["start"]
    if f"{name}/{STATE}" in context.state:
        state = context.state[f"{name}/{STATE}"]
        done = _record(context.state, f"{name}/{DONE}", ConfigRecord)
        rounds, served = _int(done, "rounds"), _int(done, "start")
        if served == start or rounds <= start:
            return from_record(state), rounds
        if directory is None:
            raise RuntimeError(
                f"fit {name!r}: the server resumed from round {start}, which this "
                "node's silo state has moved past, and the node has no "
                "checkpoint_dir to go back with."
            )
    if directory is None:
        return None, 0
    steps = checkpoint_steps(directory)
    if start > 0:
        if start not in steps:
            if any(step <= start for step in steps):
                raise RuntimeError(
                    f"fit {name!r}: the server resumed from round {start} and this "
                    f"node has no checkpoint of it (it has rounds {steps})."
                )
            return None, 0
        meta: dict[str, Any] = {"fit": name}
    else:
        if not steps:
            return None, 0
        meta = {"fit": name, "run": context.run_id}
        if checkpoint_meta(directory)[1].get("run") != context.run_id:
            return None, 0  # another run's checkpoints: this run starts afresh
    tree, step, _ = load_checkpoint(
        directory,
        silo.templates["silo"],
        expect_meta=meta,
        step=start if start > 0 else None,
    )
    return encode(tree), step


def _save_silo(directory: str, silo: RemoteSilo, state: dict, step: int, context):
    name = os.path.basename(directory)
    tree = decode(state, silo.templates["silo"], source="the silo state")
    meta = {"fit": name, "run": context.run_id}
    save_checkpoint(directory, tree, step=step, meta=meta, discard_later=True)


def _root(context: Context, root_key: Callable | None, name: str) -> jax.Array:
    if root_key is not None:
        return jax.random.fold_in(root_key(context), _name_data(name))
    if ROOT not in context.state:
        context.state[ROOT] = ConfigRecord({"seed": secrets.randbits(63)})
    seed = _int(_record(context.state, ROOT, ConfigRecord), "seed")
    return jax.random.fold_in(jax.random.key(seed), _name_data(name))


def _name_data(name: str) -> int:
    # A fit's keys differ from another fit's on the same node.
    return zlib.crc32(name.encode())
