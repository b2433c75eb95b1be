# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The MNIST and 20 Newsgroups loaders, on small files the tests write themselves."""

import gzip
import io
import tarfile

import numpy as np
import pytest

from numpyro_fed.datasets import mnist, newsgroups20, read_idx


def write_idx(path, array, type_byte=0x08):
    header = bytes([0, 0, type_byte, array.ndim])
    header += b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


@pytest.fixture
def tiny_mnist():
    rng = np.random.default_rng(0)
    return {
        "X_train": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, 5).astype(np.uint8),
        "X_test": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, 3).astype(np.uint8),
    }


@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "gz"])
def test_mnist_idx_directory(tmp_path, tiny_mnist, compressed):
    names = {
        "X_train": "train-images-idx3-ubyte",
        "y_train": "train-labels-idx1-ubyte",
        "X_test": "t10k-images-idx3-ubyte",
        "y_test": "t10k-labels-idx1-ubyte",
    }
    for field, name in names.items():
        write_idx(tmp_path / (name + (".gz" if compressed else "")), tiny_mnist[field])
    data = mnist(tmp_path)
    for field, expected in tiny_mnist.items():
        np.testing.assert_array_equal(getattr(data, field), expected)
    assert data.y_train.dtype == np.int64 and data.X_train.dtype == np.uint8


def test_mnist_npz(tmp_path, tiny_mnist):
    path = tmp_path / "mnist.npz"
    np.savez(
        path,
        x_train=tiny_mnist["X_train"],
        y_train=tiny_mnist["y_train"],
        x_test=tiny_mnist["X_test"],
        y_test=tiny_mnist["y_test"],
    )
    data = mnist(path)
    np.testing.assert_array_equal(data.X_test, tiny_mnist["X_test"])
    np.testing.assert_array_equal(data.y_train, tiny_mnist["y_train"])


def test_read_idx_big_endian_floats(tmp_path):
    x = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    write_idx(tmp_path / "x.idx", x, type_byte=0x0E)
    out = read_idx(tmp_path / "x.idx")
    np.testing.assert_array_equal(out, x)
    assert out.dtype == np.float64 and out.dtype.isnative


def test_mnist_bad_input(tmp_path, tiny_mnist):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        mnist(tmp_path)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", tiny_mnist["y_test"])
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="header announces shape"):
        read_idx(tmp_path / "short")
    np.savez(tmp_path / "partial.npz", x_train=tiny_mnist["X_train"])
    with pytest.raises(ValueError, match="y_train"):
        mnist(tmp_path / "partial.npz")


MESSAGES = {
    "20news-bydate-train/sci.space/1": "From: a@b\nSubject: orbit\n\norbit rocket rocket moon",
    "20news-bydate-train/sci.space/2": "Subject: x\n\nthe moon and the rocket",
    "20news-bydate-test/rec.autos/3": "From: c@d\n\nengine engine car the orbit",
    "20news-bydate-test/rec.autos/4": "Subject: empty\n\nthe and of",
}


def test_newsgroups_directory_and_tarball(tmp_path):
    root = tmp_path / "news"
    for name, text in MESSAGES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="latin-1")
    archive = tmp_path / "20news-bydate.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in MESSAGES.items():
            raw = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    from_dir = newsgroups20(root, vocab_size=4)
    from_tar = newsgroups20(archive, vocab_size=4)
    for a, b in zip(from_dir, from_tar, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Counts of the body words, stop words ("the", "and", "of") and headers dropped;
    # the last message is left empty and dropped; ties in frequency go alphabetically.
    assert from_dir.groups == ("rec.autos", "sci.space")
    # rocket 3; engine, moon, orbit 2 each ("orbit" in a header does not count); car 1.
    assert from_dir.vocab.tolist() == ["rocket", "engine", "moon", "orbit"]
    np.testing.assert_array_equal(
        from_dir.counts, [[0, 2, 0, 1], [2, 0, 1, 1], [1, 0, 1, 0]]
    )
    np.testing.assert_array_equal(from_dir.labels, [0, 1, 1])


def test_newsgroups_options_and_errors(tmp_path):
    root = tmp_path / "news"
    for name, text in MESSAGES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="latin-1")
    kept = newsgroups20(root, remove_headers=False, stop_words=None)
    assert "the" in kept.vocab and "subject" in kept.vocab and len(kept.labels) == 4
    with pytest.raises(ValueError, match="vocab_size"):
        newsgroups20(root, vocab_size=0)
    with pytest.raises(FileNotFoundError, match="neither a directory"):
        newsgroups20(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no message files"):
        newsgroups20(tmp_path / "empty")


def test_heart_disease_csv(tmp_path):
    from numpyro_fed.datasets import heart_disease

    header = (
        "Age,Sex,ChestPainType,RestingBP,Cholesterol,FastingBS,RestingECG,MaxHR,"
        "ExerciseAngina,Oldpeak,ST_Slope,HeartDisease\n"
    )
    rows = (
        "40,M,ATA,140,289,0,Normal,172,N,0,Up,0\n"
        "49,F,NAP,160,180,0,Normal,156,N,1,Flat,1\n"
        "37,M,ASY,130,283,1,ST,98,Y,-0.5,Down,0\n"
        "54,F,TA,150,195,0,LVH,122,N,1.5,Flat,1\n"
    )
    path = tmp_path / "heart.csv"
    path.write_text(header + rows)
    data = heart_disease(path)
    assert data.X.shape == (4, 20) and len(data.columns) == 20
    np.testing.assert_array_equal(data.y, [0.0, 1.0, 0.0, 1.0])
    # Numeric columns as given, in file order; one-hot columns hold one 1 per
    # covariate and row.
    col = {name: i for i, name in enumerate(data.columns)}
    np.testing.assert_array_equal(data.X[:, col["Age"]], [40, 49, 37, 54])
    np.testing.assert_array_equal(data.X[:, col["Oldpeak"]], [0, 1, -0.5, 1.5])
    np.testing.assert_array_equal(data.X[:, col["FastingBS"]], [0, 0, 1, 0])
    np.testing.assert_array_equal(data.X[:, col["Sex=F"]], [0, 1, 0, 1])
    np.testing.assert_array_equal(data.X[:, col["ChestPainType=TA"]], [0, 0, 0, 1])
    np.testing.assert_array_equal(data.X[:, col["RestingECG=ST"]], [0, 0, 1, 0])
    np.testing.assert_array_equal(data.X[:, col["ST_Slope=Down"]], [0, 0, 1, 0])
    for k in range(11):
        block = data.X[:, data.covariate == k]
        if not data.numeric[data.covariate == k].all():
            np.testing.assert_array_equal(block.sum(1), np.ones(4))
    assert data.numeric.sum() == 6 and sorted(set(data.covariate)) == list(range(11))
    # Columns in another order give the same arrays.
    names = header.strip().split(",")
    order = names[::-1]
    lines = [
        dict(zip(names, r.split(","), strict=True)) for r in rows.strip().split("\n")
    ]
    shuffled = tmp_path / "shuffled.csv"
    shuffled.write_text(
        ",".join(order) + "\n" + "\n".join(",".join(r[k] for k in order) for r in lines)
    )
    np.testing.assert_array_equal(heart_disease(shuffled).X, data.X)
    # Bad input names the line and the column.
    bad = tmp_path / "bad.csv"
    bad.write_text(header + rows.replace("NAP", "XYZ"))
    with pytest.raises(ValueError, match="line 3: column 'ChestPainType'"):
        heart_disease(bad)
    bad.write_text(header + rows.replace("289", "n/a"))
    with pytest.raises(ValueError, match="line 2: column 'Cholesterol'"):
        heart_disease(bad)
    bad.write_text(header + rows.replace("Up,0", "Up,2"))
    with pytest.raises(ValueError, match="HeartDisease holds '2'"):
        heart_disease(bad)
    bad.write_text(header.replace("MaxHR,", "") + rows)
    with pytest.raises(ValueError, match="missing \\['MaxHR'\\]"):
        heart_disease(bad)
