# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The one driver under every user-facing class: NumPyro's ``init / update /
stable_update / evaluate / run / get_params`` over any
:class:`~numpyro_fed.FederatedAlgorithm`, with the key in the state, a layout cache,
one participation option, one runtime option and one progress bar.

A subclass (``SFVI``, ``PVI``, ...) only says which factory to build
(:meth:`Driver._make_algorithm`) and how to read its parameters
(:meth:`Driver.get_params`).
"""

from functools import partial
import os
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from numpyro_fed.checks import (
    check_count,
    check_federated_state,
    check_participating,
    check_runtime_options,
)
from numpyro_fed.guard import check_rejections
from numpyro_fed.infer.rounds import Plateau, check_plateau, run_rounds
from numpyro_fed.protocol import FederatedAlgorithm, jit_algorithm, silo_data_of
from numpyro_fed.runtime import (
    event_round,
    event_schedule,
    sequential_round,
    sharded_round,
    silo_mesh,
    simulate_round,
)
from numpyro_fed.runtime.accounting import RoundBytes, bytes_history, silo_bytes
from numpyro_fed.runtime.checkpoint import RunCheckpoints, concat_rounds
from numpyro_fed.runtime.remote import Federation
from numpyro_fed.runtime.simulate import contacted_silos, init_states
from numpyro_fed.util import all_finite, take, tree_where

__all__ = ["Driver", "FederatedState", "RunResult"]


class FederatedState(NamedTuple):
    """- **server** - the algorithm's server state.
    - **silos** - the silos' states, stacked along a leading silo axis (in a
      deployment each silo holds only its own row).
    - **rng_key** - the key the next round splits.
    """

    server: Any
    silos: Any
    rng_key: jax.Array


class RunResult(NamedTuple):
    """- **params** - the final (constrained) parameters.
    - **state** - the final state, to resume with ``run(..., init_state=state)``.
    - **losses** - the negative ELBO estimate of every round.
    - **history** - the server's info of every round, stacked by field (``loss``,
      ``rejected``, ...), plus what the algorithm records of its state, the silos
      each round ``contacted`` and the bytes it sent each way (``bytes_down``,
      ``bytes_up``, summed over those silos; :func:`~numpyro_fed.runtime.silo_bytes`).
    """

    params: Any
    state: Any
    losses: jax.Array
    history: dict


class Driver:
    """
    The run loop shared by every federated algorithm class.

    :param str runtime: ``"simulate"`` (every silo in one vmapped, jitted round),
        ``"sequential"`` (one silo after another, in Python) or ``"events"`` (one
        silo at a time in ``order``, the server updating after each reply; with
        ``max_staleness > 0`` silos read messages up to that many updates old: the
        asynchronous schedule). ``"sharded"`` is ``"simulate"`` with the silos spread
        over all local devices (:func:`~numpyro_fed.runtime.sharded_round`; the
        server side runs replicated; silos of different structure, as vertical
        SFVI's parties, by group: :func:`~numpyro_fed.runtime.sharded_group_round`).
    :param float participation: fraction of silos taking part in each round, drawn
        uniformly at random.
    :param str order: ``"cyclic"`` or ``"random"`` visiting order (events runtime).
    :param int max_staleness: largest staleness of a message (events runtime).
    :param float max_rejected: :meth:`run` stops with
        :class:`~numpyro_fed.guard.SiloFailure` when a silo's replies were
        rejected (not finite, or not valid) in more than this fraction of the rounds
        it was contacted in; ``None`` never stops (every rejection is still named in
        a warning).
    """

    description = "rounds"
    #: Without a progress bar, runs of at least this many rounds go inside one
    #: ``lax.scan``; shorter ones loop over the jitted round (a scan compiles the
    #: round a second time, which only pays off over many rounds).
    min_scan_steps = 1
    #: Contract rounds per round, all on the round's keys (``Federation.exchanges``).
    exchanges = 1

    def __init__(
        self,
        *,
        runtime: str = "simulate",
        participation: float = 1.0,
        order: str = "cyclic",
        max_staleness: int = 0,
        max_rejected: float | None = 0.25,
    ) -> None:
        max_staleness = check_runtime_options(
            runtime, participation, order, max_staleness, max_rejected
        )
        self.runtime = runtime
        self.participation = participation
        self.order = order
        self.max_staleness = max_staleness
        self.max_rejected = max_rejected
        self._built: dict = {}
        # Per layout: real sizes of the ragged nested plates (set by ``_setup``).
        self._nested: dict = {}

    # ------------------------------------------------------------- subclass hooks
    def _make_algorithm(self, data: Any) -> FederatedAlgorithm:
        """The algorithm for this data (the guide is already set up)."""
        raise NotImplementedError

    def _setup(self, data: Any) -> None:
        """Prepare for this data layout (e.g. trace the model); once per layout."""

    def _silo_data(self, data: Any) -> Any:
        """The silos' data as the round function takes it (default: the stacked
        :class:`~numpyro_fed.protocol.SiloData`, with the real sizes of the
        ragged nested plates that ``_setup`` found)."""
        return silo_data_of(data, self._nested.get(self._layout(data)))

    def _round_keys(self, rng_key: jax.Array, num_silos: int):
        """``(next_rng_key, server_key, silo_keys)`` of one round."""
        rng_key, server_key, silo_key = jax.random.split(rng_key, 3)
        return rng_key, server_key, jax.random.split(silo_key, num_silos)

    def _from_params(self, params: Any, data: Any) -> tuple[Any, Any]:
        """``(server, silos)`` states that start from ``params`` (warm start)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot start from init_params."
        )

    def _record(self, state: FederatedState) -> dict:
        """What to keep of the state after each round, besides the server's info."""
        del state
        return {}

    def _silo_groups(self) -> tuple | None:
        """The silos' groups of equal structure (``None``: one stacked group)."""
        return None

    def _silo_labels(self) -> Any:
        """How messages name silo j: ``labels[j]`` (``None``: ``"silo j"``)."""
        return None

    def _check_info(self, state: FederatedState, info: Any) -> None:
        """Raise on an info that must stop the run (``state``: before the round)."""

    def get_params(self, state: FederatedState) -> Any:
        """The constrained parameters of ``state``."""
        raise NotImplementedError

    # --------------------------------------------------------------- construction
    @staticmethod
    def _layout(data: Any) -> tuple:
        return (data.sizes, data.padded_size) + tuple(
            (k, v.shape, str(v.dtype)) for k, v in sorted(data.arrays.items())
        )

    def _build(self, data: Any):
        """The algorithm and its round function for this data layout (cached)."""
        layout = self._layout(data)
        if layout not in self._built:
            self._setup(data)
            algorithm = self._make_algorithm(data)
            round_fn: Callable
            if self.runtime == "simulate":
                round_fn = jax.jit(partial(simulate_round, algorithm))
            elif self.runtime == "sharded":
                round_fn = jax.jit(partial(sharded_round, algorithm, silo_mesh()))
            elif self.runtime == "events":
                round_fn = jax.jit(
                    partial(event_round, algorithm, max_staleness=self.max_staleness)
                )
            else:
                round_fn = partial(sequential_round, jit_algorithm(algorithm))
            self._built[layout] = (algorithm, round_fn)
        return self._built[layout]

    def federation(self, data: Any) -> Federation:
        """
        What the processes of a deployed run agree on for this data layout: the
        algorithm, the number of silos, one silo's data layout, the server's key
        chain and, for the events runtime, its schedule, for
        :mod:`numpyro_fed.runtime.flower` (or any transport over
        :mod:`numpyro_fed.runtime.remote`).

        ``data`` gives the layout (silo count, padded units, array shapes) and, in its
        silo 0, the one unit on which the server runs the model to size the global
        sites (:func:`~numpyro_fed.densities.data_template`): in a deployment, values
        valid for the model (zeros fail where data sit in a scale parameter). Each
        silo then draws its own keys, so a deployed SFVI is ``reproducible=False``.

        :param FederatedData data: the silos' data, or valid stand-ins of their
            layout.
        :rtype: ~numpyro_fed.runtime.remote.Federation
        """
        algorithm, _ = self._build(data)
        num_silos, events = data.num_silos, self.runtime == "events"
        _, _, silo_keys = jax.eval_shape(
            lambda key: self._round_keys(key, num_silos), jax.random.key(0)
        )
        return Federation(
            algorithm,
            num_silos,
            self._silo_spec(data),
            lambda key: self._round_keys(key, num_silos)[:2],
            jax.ShapeDtypeStruct(silo_keys.shape[1:], silo_keys.dtype),
            self.exchanges,
            partial(self._schedule, num_silos=num_silos) if events else None,
        )

    def _silo_spec(self, data: Any) -> Any:
        """A deployed silo's data layout (or a tuple of one per silo)."""
        silo_data = self._silo_data(data)
        return jax.eval_shape(lambda: take(silo_data, 0))

    def _check(self, state: FederatedState, data: Any) -> None:
        """Raise unless ``state`` has the layout :meth:`init` gives on ``data``
        (built here, outside any trace: a fresh object may resume a state)."""

        def expected(rng_key: jax.Array) -> Any:
            self._build(data)
            key = ("state", self._layout(data), rng_key.dtype, rng_key.shape)
            if key not in self._built:
                self._built[key] = jax.eval_shape(lambda k: self.init(k, data), rng_key)
            return self._built[key]

        name = type(self).__name__
        fix = f"start from {name}.init(key, data) on these data"
        check_federated_state(name, state, data.num_silos, expected, fix)

    # ---------------------------------------------------------------- NumPyro API
    def init(
        self, rng_key: jax.Array, data: Any, *, init_params: Any = None
    ) -> FederatedState:
        """
        :param jax.random.key rng_key: random key.
        :param FederatedData data: the silos' data.
        :param init_params: optional starting (constrained) parameters, e.g. a
            previous run's ``result.params`` (warm start).
        :return: the initial state.
        """
        algorithm, _ = self._build(data)
        if init_params is not None:
            server, silos = self._from_params(init_params, data)
            rng_key = jax.random.split(rng_key, 3)[0]
        else:
            key = ("init", self._layout(data))
            if key not in self._built:  # the keys and all states: one program
                self._built[key] = jax.jit(init_states(algorithm, data.num_silos))
            server, silos, rng_key = self._built[key](rng_key, self._silo_data(data))
        # Strong dtypes: weak-typed leaves would make the jitted round recompile.
        return jax.tree.map(
            lambda x: jnp.asarray(x, x.dtype) if hasattr(x, "dtype") else x,
            FederatedState(server, silos, rng_key),
        )

    def _participants(self, rng_key: jax.Array, num_silos: int) -> jax.Array | None:
        if self.participation == 1:
            return None
        count = max(1, round(self.participation * num_silos))
        # fold_in, not split: participation must not shift the round's key chain.
        order = jax.random.permutation(jax.random.fold_in(rng_key, 7919), num_silos)
        return jnp.zeros((num_silos,), bool).at[order[:count]].set(True)

    def _schedule(self, rng_key: jax.Array, num_silos: int):
        """``(next_rng_key, schedule)`` of one pass of events: event i's server key
        continues the key chain as round i would, so one silo's events are rounds."""
        chain = lambda key, _: self._round_keys(key, num_silos)[:2]  # noqa: E731
        next_key, server_keys = lax.scan(chain, rng_key, None, length=num_silos)
        schedule = event_schedule(
            jax.random.fold_in(rng_key, 104729),
            num_silos,
            order=self.order,
            max_staleness=self.max_staleness,
            server_keys=server_keys,
        )
        return next_key, schedule

    @partial(jax.jit, static_argnums=(0, 2))
    def _round_inputs(self, rng_key: jax.Array, num_silos: int):
        """The round's keys (the events runtime: its schedule as the server key), in
        one compiled call rather than a string of small eager ones."""
        rng_key_next, server_key, silo_keys = self._round_keys(rng_key, num_silos)
        if self.runtime == "events":
            rng_key_next, server_key = self._schedule(rng_key, num_silos)
        return rng_key_next, server_key, silo_keys

    def update_with_info(
        self, state: FederatedState, data: Any, participating: jax.Array | None = None
    ) -> tuple[FederatedState, Any]:
        """Like :meth:`update`, returning the server's info (for the events runtime,
        stacked along a leading event axis) instead of the loss."""
        self._check(state, data)
        new_state, info, _ = self._round(state, data, participating)
        self._check_info(state, info)
        return new_state, info

    def _round(self, state, data: Any, participating: Any, silo_data: Any = None):
        """``(state, info, contacted)``: the round (on ``silo_data``, by default
        ``data``'s), and the ``(J,)`` silos it contacted."""
        algorithm, round_fn = self._build(data)
        num_silos = data.num_silos
        if participating is None:
            participating = self._participants(state.rng_key, num_silos)
        else:
            participating = check_participating(participating, num_silos)
        rng_key, server_key, silo_keys = self._round_inputs(state.rng_key, num_silos)
        server, silos, info = round_fn(
            state.server,
            state.silos,
            self._silo_data(data) if silo_data is None else silo_data,
            server_key,
            silo_keys,
            participating,
        )
        contacted = jnp.ones((num_silos,), bool)  # an events pass visits every silo
        if self.runtime != "events":
            picked = contacted_silos(
                algorithm, state.server, server_key, num_silos, participating
            )
            contacted = contacted if picked is None else picked
        return FederatedState(server, silos, rng_key), info, contacted

    def update(
        self, state: FederatedState, data: Any, participating: jax.Array | None = None
    ) -> tuple[FederatedState, jax.Array]:
        """
        One round.

        :param FederatedState state: current state.
        :param FederatedData data: the silos' data.
        :param jax.Array participating: optional ``(J,)`` booleans naming the silos
            that take part (e.g. silos that dropped out are False); by default all,
            or a random ``participation`` fraction.
        :return: ``(state, loss)``, the loss at the pre-update state (the events
            runtime: the mean over the round's events).
        """
        state, info = self.update_with_info(state, data, participating)
        return state, _round_loss(info, self.runtime)

    def stable_update(
        self, state: FederatedState, data: Any, participating: jax.Array | None = None
    ) -> tuple[FederatedState, jax.Array]:
        """Like :meth:`update`, but a round whose loss or state is not finite is not
        applied (the key still advances)."""
        new_state, loss = self.update(state, data, participating)
        return _keep_if_finite(new_state, state, loss), loss

    def evaluate(self, state: FederatedState, data: Any) -> jax.Array:
        """The loss (negative ELBO estimate) at ``state``, without updating it."""
        return self.update(state, data)[1]

    def run(
        self,
        rng_key: jax.Array,
        num_steps: int,
        data: Any,
        *,
        progress_bar: bool = True,
        stable_update: bool = False,
        init_state: FederatedState | None = None,
        init_params: Any = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        resume: bool = False,
        stop: Plateau | None = None,
    ) -> RunResult:
        """
        Run ``num_steps`` rounds: inside ``lax.scan`` without a progress bar,
        otherwise one jitted round at a time under a tqdm bar (NumPyro's two modes).

        With ``checkpoint_dir``, the state and the history so far are written there
        (atomically, see :mod:`~numpyro_fed.runtime.checkpoint`) every
        ``checkpoint_every`` rounds and at the end; the scan then runs in chunks of
        ``checkpoint_every`` rounds, which gives the same result as one scan. With
        ``resume=True`` the run starts from the newest checkpoint there and runs
        only the remaining rounds of ``num_steps``: a run killed after round m and
        resumed ends bit for bit where an uninterrupted run ends (same runtime
        options and mode). A checkpoint of another algorithm, model, data layout or
        runtime option is refused with a
        :class:`~numpyro_fed.runtime.checkpoint.CheckpointError`.

        :param jax.random.key rng_key: random key (ignored with ``init_state`` or
            when resuming).
        :param int num_steps: number of rounds (in all, when resuming).
        :param FederatedData data: the silos' data.
        :param bool progress_bar: show a tqdm bar (otherwise ``lax.scan``).
        :param bool stable_update: skip rounds whose result is not finite.
        :param init_state: resume from this state (with ``resume``, only its
            layout is used).
        :param init_params: start from these parameters (warm start).
        :param int checkpoint_every: save every this many rounds (default: at the
            end only).
        :param checkpoint_dir: directory of the checkpoints; a run that does not
            resume needs it empty (or new).
        :param bool resume: continue from the newest checkpoint in
            ``checkpoint_dir``.
        :param Plateau stop: end the run early once the loss stops moving
            (:class:`~numpyro_fed.infer.rounds.Plateau`); ``num_steps`` is then
            the budget.
        :return: :class:`RunResult`, with the history of all ``num_steps`` rounds.

        **Example:**

        .. doctest::

            >>> import tempfile
            >>> import jax, jax.numpy as jnp, optax
            >>> import numpyro, numpyro.distributions as dist
            >>> import numpyro_fed as nf
            >>> def model(y):
            ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            ...     with numpyro.plate("data", y.shape[0]):
            ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
            >>> data = nf.FederatedData.from_groups([0, 0, 1, 1], y=jnp.arange(4.0))
            >>> fed = nf.federate(model, silos="data")
            >>> svi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.1))
            >>> key = jax.random.key(0)
            >>> with tempfile.TemporaryDirectory() as d:  # killed after 20 rounds...
            ...     _ = svi.run(key, 20, data, checkpoint_every=10, checkpoint_dir=d)
            ...     resumed = svi.run(key, 50, data, checkpoint_dir=d, resume=True)
            >>> whole = svi.run(key, 50, data)
            >>> bool(jnp.all(resumed.losses == whole.losses))
            True
        """
        num_steps = check_count("num_steps", num_steps)
        if checkpoint_dir is None and (checkpoint_every is not None or resume):
            raise ValueError("checkpoint_every and resume need a checkpoint_dir.")
        saver, done, past = None, 0, None
        if checkpoint_dir is not None:  # another run's checkpoint: refused now
            meta = self._run_meta(data, stable_update)
            saver = RunCheckpoints.open(
                checkpoint_dir, meta, checkpoint_every, resume, num_steps
            )
        state = (
            init_state
            if init_state is not None
            else self.init(rng_key, data, init_params=init_params)
        )
        self._check(state, data)
        step, step_fn, scans = self._run_fns(data, stable_update)
        if resume and saver is not None:  # resume implies a saver (checked above)
            everyone = jnp.ones((data.num_silos,), bool)  # shapes only
            record = jax.eval_shape(lambda s: step(s, participating=everyone)[1], state)
            state, past, done = saver.load(state, record, num_steps)
        if self.runtime == "sharded":  # placed as its rounds return it: one compile
            state = jax.device_put(state, NamedSharding(silo_mesh(), PartitionSpec()))
        scan = not progress_bar and self.runtime != "sequential"
        state, history = run_rounds(
            step_fn,
            scans,
            state,
            done=done,
            num_steps=num_steps,
            scan=scan and num_steps >= self.min_scan_steps,
            progress_bar=progress_bar,
            saver=saver,
            check=self._check_info,
            stop=check_plateau(stop),
            past=past,
            description=self.description,
        )
        history = concat_rounds(past, history)
        if history is None:  # num_steps >= 1 rounds either ran or were loaded
            raise RuntimeError(f"{type(self).__name__}.run recorded no rounds.")
        sizes = self._wire_bytes(data, state)
        history.update(bytes_history(history["contacted"], sizes, self.exchanges))
        result = RunResult(self.get_params(state), state, history["loss"], history)
        check_rejections(
            type(self).__name__,
            history,
            self.max_rejected,
            result,
            labels=self._silo_labels(),
        )
        return result

    def _wire_bytes(self, data: Any, state: FederatedState) -> RoundBytes:
        """What each silo exchanges per contract round when contacted (cached)."""
        key = ("bytes", self._layout(data), self._silo_groups())
        if key not in self._built:
            algorithm, _ = self._build(data)
            round_keys = partial(self._round_keys, num_silos=data.num_silos)
            keys = jax.eval_shape(lambda k: round_keys(k)[1:], state.rng_key)
            server_key, silo_keys = keys
            silo_data, groups = self._silo_data(data), self._silo_groups()
            self._built[key] = silo_bytes(
                algorithm, state.server, state.silos, silo_data, server_key, silo_keys,
                groups,
            )  # fmt: skip
        return self._built[key]

    def _run_meta(self, data: Any, stable_update: bool) -> dict:
        """What a resumed run must share with the run that wrote the checkpoint."""
        return {
            "algorithm": type(self).__name__,
            "runtime": self.runtime,
            "participation": self.participation,
            "order": self.order,
            "max_staleness": self.max_staleness,
            "stable_update": bool(stable_update),
            "data_layout": repr(self._layout(data)),
        }

    def _run_fns(self, data: Any, stable_update: bool):
        """``(step, jitted step, scans)`` of :meth:`run`: one round with its record,
        and ``scans(length)``, ``length`` rounds in one ``lax.scan``. Kept for the
        last data and options, so that a second run (a resumed one) compiles
        nothing new."""
        options = (
            stable_update,
            self.runtime,
            self.participation,
            self.order,
            self.max_staleness,
        )
        key = (self._run_key(data), options)
        cached = self._built.get("run")
        if cached is None or cached[0] != key:
            cached = (key, self._round_fns(data, stable_update))
            self._built["run"] = cached
        step, jitted, scans = cached[1]
        silo_data = self._silo_data(data)  # an argument: new data compile nothing
        return (
            partial(step, silo_data=silo_data),
            lambda state: jitted(state, silo_data),
            lambda length: lambda state: scans(length)(state, silo_data),
        )

    def _run_key(self, data: Any) -> Any:
        """What a cached run loop depends on (the data's layout, not its values)."""
        return self._layout(data)

    def _round_fns(self, data: Any, stable_update: bool):
        """``(step, jitted step, scans)`` on the silos' data as an argument."""
        runtime = self.runtime

        def step(state, silo_data, participating=None):
            new, info, contacted = self._round(state, data, participating, silo_data)
            loss = _round_loss(info, runtime)
            if stable_update:
                new = _keep_if_finite(new, state, loss)
            record = {**info._asdict(), **self._record(new), "loss": loss}
            record["contacted"] = contacted
            return new, record

        # The sequential runtime is a Python loop over silos: never traced.
        step_fn = step if runtime == "sequential" else jax.jit(step)
        compiled = {}

        def scans(length: int):
            def rounds(state, silo_data):
                return lax.scan(
                    lambda s, _: step_fn(s, silo_data), state, length=length
                )

            if length not in compiled:
                compiled[length] = jax.jit(rounds)
            return compiled[length]

        return step, step_fn, scans


def _keep_if_finite(new: FederatedState, old: FederatedState, loss) -> FederatedState:
    """``new`` if its loss and state are finite, else ``old`` with ``new``'s key (as
    NumPyro's ``stable_update``)."""
    ok = jnp.isfinite(loss) & all_finite(new)
    return tree_where(ok, new, old)._replace(rng_key=new.rng_key)


def _round_loss(info: Any, runtime: str) -> jax.Array:
    return jnp.mean(info.loss) if runtime == "events" else info.loss
