# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Checkpoints: any pytree of arrays (a run's state and history, one node's silo
state) written atomically to a directory every few rounds, and read back against a
template, so that a killed run resumes exactly where it stopped.

One checkpoint is one ``checkpoint-<step>.npz`` file holding the tree's leaves as
:func:`~numpyro_fed.runtime.codec.encode` makes them (typed PRNG keys as their key
data) and a JSON entry with the step, the tree's
:func:`~numpyro_fed.runtime.codec.fingerprint`, the format version and the caller's
metadata. A file is written under a temporary name in the same directory, flushed to
disk and renamed (:func:`os.replace`), so the newest checkpoint is always a whole one.
Reading refuses, with a :class:`CheckpointError` naming the file and what differs, a
file that cannot be read, one written for another tree (model, guide, data layout,
algorithm) and one whose metadata differ from what the caller expects.
"""

import contextlib
import json
import os
from pathlib import Path
import re
import tempfile
from typing import Any
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.checks import check_count
from numpyro_fed.runtime.codec import TemplateMismatch, decode, encode, fingerprint

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "RunCheckpoints",
    "checkpoint_meta",
    "checkpoint_steps",
    "concat_rounds",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

#: Version of the file layout; a file of another version is refused.
FORMAT_VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)\.npz$")
_META = "checkpoint_meta"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or written for something else (the
    message names the directory or file and what differs)."""


def _path(directory: Path, step: int) -> Path:
    return directory / f"checkpoint-{step:09d}.npz"


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the checkpoints in ``directory``, oldest first (none: ``[]``)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = (_NAME.match(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in steps if m)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint file in ``directory``, or ``None`` if it holds none."""
    steps = checkpoint_steps(directory)
    return _path(Path(directory), steps[-1]) if steps else None


def save_checkpoint(
    directory: str | os.PathLike,
    tree: Any,
    *,
    step: int,
    meta: dict | None = None,
    keep: int = 2,
    discard_later: bool = False,
) -> Path:
    """
    Write ``tree`` as the checkpoint of ``step`` in ``directory`` (created if
    needed), atomically, and delete all but the newest ``keep`` checkpoints.

    :param directory: where checkpoints live.
    :param tree: a pytree of arrays (typed PRNG keys included).
    :param int step: the step (e.g. rounds done) this tree is the state after.
    :param dict meta: JSON-serialisable facts to check on reading (the algorithm,
        the runtime options, the data layout).
    :param int keep: how many checkpoints to keep (at least 1).
    :param bool discard_later: delete checkpoints of later steps first (a run that
        went back to ``step`` abandons them) instead of refusing.
    :return: the path written.
    :raises CheckpointError: ``directory`` holds a checkpoint of a later step (it
        belongs to another run) and ``discard_later`` is False.

    **Example:**

    .. doctest::

        >>> import tempfile
        >>> import jax, jax.numpy as jnp
        >>> from numpyro_fed.runtime.checkpoint import load_checkpoint, save_checkpoint
        >>> tree = {"theta": jnp.arange(3.0), "key": jax.random.key(0)}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = save_checkpoint(d, tree, step=10, meta={"algorithm": "SFVI"})
        ...     back, step, meta = load_checkpoint(
        ...         d, tree, expect_meta={"algorithm": "SFVI"}
        ...     )
        >>> step, meta, back["theta"].tolist()
        (10, {'algorithm': 'SFVI'}, [0.0, 1.0, 2.0])
    """
    step = check_count("step", step, minimum=0)
    keep = check_count("keep", keep)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    steps = checkpoint_steps(directory)
    if discard_later:
        for later in (s for s in steps if s > step):
            _path(directory, later).unlink()
        steps = [s for s in steps if s <= step]
    if steps and steps[-1] > step:
        raise CheckpointError(
            f"{directory} holds a checkpoint of step {steps[-1]}, later than step "
            f"{step}: it belongs to another run (use an empty directory)."
        )
    flat = encode(tree)
    header = {
        "format": FORMAT_VERSION,
        "step": step,
        "fingerprint": fingerprint(tree),
        "fields": list(flat),
        "dtypes": [str(x.dtype) for x in flat.values()],
        "meta": {} if meta is None else meta,
    }
    try:
        text = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serialisable: {e}") from None
    # Any: numpy's stub would match a key named allow_pickle to that bool argument.
    arrays: dict[str, Any] = {f"leaf_{i}": x for i, x in enumerate(flat.values())}
    arrays[_META] = np.frombuffer(text.encode(), np.uint8)
    final = _path(directory, step)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
    for old in checkpoint_steps(directory)[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            _path(directory, old).unlink()
    return final


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX).
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(
    directory: str | os.PathLike,
    template: Any,
    *,
    expect_meta: dict | None = None,
    step: int | None = None,
) -> tuple[Any, int, dict]:
    """
    Read the newest checkpoint in ``directory`` (or that of ``step``) against
    ``template``.

    :param directory: where :func:`save_checkpoint` wrote.
    :param template: a tree with the expected structure, shapes and dtypes (leaves
        may be ``jax.ShapeDtypeStruct``), or a callable ``template(step, meta)``
        returning one, for trees whose shapes grow with the step (a history).
    :param dict expect_meta: entries the stored metadata must have, with these
        values.
    :param int step: read this step's checkpoint instead of the newest.
    :return: ``(tree, step, meta)``.
    :raises CheckpointError: no such directory or no checkpoint in it; a file that
        is not a whole checkpoint (truncated, not an ``.npz``, bad metadata, another
        format version); a checkpoint of another tree (named field, shape or
        dtype), or whose metadata differ from ``expect_meta`` (named entry).
    """
    path = _newest(directory)
    if step is not None:
        path = _path(Path(directory), step)
        if not path.is_file():
            raise CheckpointError(
                f"No checkpoint of step {step} in {directory} (it has steps "
                f"{checkpoint_steps(directory)})."
            )
    header, flat = _read(path)
    step, meta = header["step"], header["meta"]
    _check_meta(path, meta, expect_meta)
    if callable(template):
        template = template(step, meta)
    source = f"Checkpoint {path}"
    try:
        tree = decode(flat, template, source=source)
    except TemplateMismatch as e:
        raise CheckpointError(
            f"{e} It was written for another model, guide, data layout or algorithm."
        ) from None
    if fingerprint(tree) != header["fingerprint"]:
        # Same fields and arrays, another kind of leaf (e.g. another key type).
        stored = header["fingerprint"].split(";")
        ours = fingerprint(tree).split(";")
        first = next(
            (
                f"{a} (expected {b})"
                for a, b in zip(stored, ours, strict=False)
                if a != b
            ),
            "a different structure",
        )
        raise CheckpointError(f"{source} holds {first}.")
    return tree, step, meta


def checkpoint_meta(
    directory: str | os.PathLike, *, expect_meta: dict | None = None
) -> tuple[int, dict]:
    """
    The step and metadata of the newest checkpoint in ``directory``, without
    reading its arrays (to refuse another run's checkpoint before any work).

    :raises CheckpointError: as :func:`load_checkpoint`, for the directory, the
        metadata and ``expect_meta``.
    """
    path = _newest(directory)
    header, _ = _read(path, arrays=False)
    _check_meta(path, header["meta"], expect_meta)
    return header["step"], header["meta"]


def _newest(directory: str | os.PathLike) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"No checkpoint directory {directory}.")
    path = latest_checkpoint(directory)
    if path is None:
        raise CheckpointError(f"No checkpoint in {directory}.")
    return path


def _check_meta(path: Path, meta: dict, expect_meta: dict | None) -> None:
    if expect_meta is None:
        return
    # Compare as stored: JSON turns tuples into lists.
    for name, value in json.loads(json.dumps(expect_meta)).items():
        if name not in meta:
            raise CheckpointError(f"{path} has no {name!r} in its metadata.")
        if meta[name] != value:
            raise CheckpointError(
                f"{path} was written with {name}={meta[name]!r}; this run has "
                f"{name}={value!r}."
            )


def _read(path: Path, arrays: bool = True) -> tuple[dict, dict]:
    """The header and ``{field: array}`` of one file (only the header: ``arrays``
    False); any damage is a :class:`CheckpointError` naming it."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            names = npz.files if arrays else [n for n in npz.files if n == _META]
            raw = {name: npz[name] for name in names}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({type(e).__name__}: {e})."
        ) from None
    if _META not in raw:
        raise CheckpointError(f"{path} is not a checkpoint: it has no metadata.")
    try:
        header = json.loads(raw.pop(_META).tobytes().decode())
        fields, dtypes = header["fields"], header["dtypes"]
        header["step"], header["meta"], header["fingerprint"]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path} has unreadable metadata ({e}).") from None
    if header.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {header.get('format')!r}; this version of "
            f"numpyro-fed reads version {FORMAT_VERSION}."
        )
    if not arrays:
        return header, {}
    if sorted(raw) != sorted(f"leaf_{i}" for i in range(len(fields))) or len(
        dtypes
    ) != len(fields):
        raise CheckpointError(
            f"{path} lists {len(fields)} fields but holds {len(raw)} arrays."
        )
    flat = {}
    for i, (name, dtype) in enumerate(zip(fields, dtypes, strict=True)):
        value = raw[f"leaf_{i}"]
        if str(value.dtype) != dtype:  # e.g. bfloat16, which .npy stores as bytes
            value = value.view(jnp.dtype(dtype))
        flat[name] = value
    return header, flat


def concat_rounds(*histories: dict | None) -> dict | None:
    """Histories (trees stacked along a leading round axis) one after another;
    ``None`` stands for no rounds."""
    parts = [h for h in histories if h is not None]
    if len(parts) < 2:
        return parts[0] if parts else None
    return jax.tree.map(lambda *x: jnp.concatenate(x), *parts)


class RunCheckpoints:
    """
    The checkpoints of one run loop: ``{"state": state, "history": history}`` every
    ``every`` rounds (and at the end), where ``history`` stacks one record per round
    along a leading axis. A resumed run continues from :attr:`done` rounds, and
    what it saves includes the history it resumed with (:attr:`past`).

    :param directory: where the checkpoints live.
    :param dict meta: what a resumed run must share with the writer (checked on
        :meth:`load`): the algorithm, the runtime options, the data layout.
    :param int every: rounds between checkpoints (``None``: at the end only).
    :param int keep: how many checkpoints to keep.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        meta: dict,
        *,
        every: int | None = None,
        keep: int = 2,
    ) -> None:
        if every is not None:
            every = check_count("checkpoint_every", every)
        self.directory, self.meta, self.every, self.keep = directory, meta, every, keep
        #: rounds done when the run started (read by :meth:`load`)
        self.done = 0
        #: the history read by :meth:`load` (``None``: no rounds)
        self.past = None

    @classmethod
    def open(
        cls, directory, meta: dict, every: int | None, resume: bool, num_steps: int
    ) -> "RunCheckpoints":
        """The checkpoints of a run of ``num_steps`` rounds: with ``resume``, those
        of the same run (refused otherwise), else an empty (or new) directory."""
        saver = cls(directory, meta, every=every)
        if resume:
            saver.check_meta(num_steps)
        else:
            saver.check_empty()
        return saver

    def next_stop(self, start: int, num_steps: int) -> int:
        """The first checkpoint after round ``start`` (or ``num_steps``)."""
        if self.every is None:
            return num_steps
        return min((start // self.every + 1) * self.every, num_steps)

    def check_empty(self) -> None:
        """Refuse to start a new run over another run's checkpoints."""
        last = latest_checkpoint(self.directory)
        if last is not None:
            raise CheckpointError(
                f"{self.directory} already holds a checkpoint ({last.name}): resume "
                "that run, or use an empty directory."
            )

    def check_meta(self, num_steps: int) -> None:
        """Refuse, before any work, a checkpoint of another run or one beyond
        ``num_steps`` rounds."""
        done, _ = checkpoint_meta(self.directory, expect_meta=self.meta)
        if done > num_steps:
            raise CheckpointError(
                f"The checkpoint in {self.directory} is after round {done}, beyond "
                f"num_steps={num_steps}."
            )

    def load(self, state: Any, record: Any, num_steps: int) -> tuple[Any, Any, int]:
        """
        :param state: template of the state.
        :param record: one round's record, as shapes (``jax.eval_shape``).
        :param int num_steps: the rounds the run has in all.
        :return: ``(state, history, rounds done)`` of the newest checkpoint.
        """

        def template(step: int, meta: dict) -> dict:
            del meta
            rounds = jax.tree.map(
                lambda r: jax.ShapeDtypeStruct((step, *r.shape), r.dtype), record
            )
            return {"state": state, "history": rounds}

        tree, done, _ = load_checkpoint(self.directory, template, expect_meta=self.meta)
        if done > num_steps:
            raise CheckpointError(
                f"The checkpoint in {self.directory} is after round {done}, beyond "
                f"num_steps={num_steps}."
            )
        self.done, self.past = done, (tree["history"] if done else None)
        return tree["state"], self.past, done

    def save(self, state: Any, history: dict, step: int) -> Path:
        """Save ``state`` after round ``step``; ``history``: the rounds since
        :attr:`done`."""
        tree = {"state": state, "history": concat_rounds(self.past, history)}
        return save_checkpoint(
            self.directory, tree, step=step, meta=self.meta, keep=self.keep
        )
