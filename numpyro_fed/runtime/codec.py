# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""One codec for every state, message and reply: a pytree of arrays as a flat dict of
numpy arrays keyed by tree path, and back against a template.

Transports (Flower records) and checkpoints (``.npz`` files) both ship flat dicts, so
neither needs to know any algorithm. Decoding checks every field against the template
(missing or extra keys, shape, dtype) and names the first that does not match, so a
reply from a different version of a model is refused before anything is applied.
Typed PRNG keys travel as their key data and come back with the template's
implementation.
"""

import json
from typing import Any

import jax
import numpy as np

__all__ = ["TemplateMismatch", "decode", "encode", "fingerprint", "pack", "unpack"]


class TemplateMismatch(ValueError):
    """A flat dict that does not match its template (names the source and field)."""


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) for p, _ in leaves], [x for _, x in leaves], treedef


def encode(tree: Any) -> dict[str, np.ndarray]:
    """
    ``tree`` as ``{tree path: numpy array}``, dtypes kept.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.runtime.codec import decode, encode
        >>> flat = encode({"a": jnp.ones(2), "b": (jnp.int32(3),)})
        >>> sorted(flat)
        ["['a']", "['b'][0]"]
        >>> decode(flat, {"a": jnp.zeros(2), "b": (jnp.int32(0),)})["b"][0]
        Array(3, dtype=int32)
    """
    names, leaves, _ = _paths(tree)
    if len(set(names)) != len(names):
        raise ValueError("Two leaves of the tree have the same path.")
    return {
        name: np.asarray(jax.random.key_data(x) if _is_key(x) else x)
        for name, x in zip(names, leaves, strict=True)
    }


def decode(flat: dict, template: Any, *, source: str = "the input") -> Any:
    """
    The tree of ``template``'s structure whose leaves are ``flat``'s arrays.

    :param dict flat: ``{tree path: array}``, as :func:`encode` makes.
    :param template: a tree with the expected structure; its leaves may be arrays or
        ``jax.ShapeDtypeStruct``.
    :param str source: who sent ``flat`` (named in errors).
    :raises TemplateMismatch: a missing or unexpected field, or a field whose shape
        or dtype differs from the template's.
    """
    names, leaves, treedef = _paths(template)
    missing = [n for n in names if n not in flat]
    extra = sorted(set(flat) - set(names))
    if missing or extra:
        what = f"lacks field {missing[0]}" if missing else f"has extra field {extra[0]}"
        raise TemplateMismatch(f"{source} {what} (expected fields: {names}).")
    out = []
    for name, like in zip(names, leaves, strict=True):
        value = np.asarray(flat[name])
        if _is_key(like):
            data_like = jax.eval_shape(jax.random.key_data, like)
            _check(value, data_like.shape, data_like.dtype, source, name)
            # The dtype carries the implementation (what jax.random.key_impl reads),
            # and a ShapeDtypeStruct template has no other way to give it.
            key_data = jax.numpy.asarray(value)
            out.append(jax.random.wrap_key_data(key_data, impl=like.dtype._impl))
            continue
        _check(value, np.shape(like), np.dtype(like.dtype), source, name)
        out.append(jax.numpy.asarray(value))
    return jax.tree.unflatten(treedef, out)


def _check(value: np.ndarray, shape, dtype, source: str, name: str) -> None:
    if value.shape != tuple(shape) or value.dtype != dtype:
        raise TemplateMismatch(
            f"{source}: field {name} is {value.dtype}{list(value.shape)}, "
            f"expected {np.dtype(dtype)}{list(shape)}."
        )


def fingerprint(tree: Any) -> str:
    """A string naming ``tree``'s fields, shapes and dtypes (to tell whether a stored
    tree can be read against a template)."""
    names, leaves, _ = _paths(tree)
    return ";".join(
        f"{n}:{x.dtype}{list(np.shape(x))}" for n, x in zip(names, leaves, strict=True)
    )


def pack(flat: dict) -> tuple[str, bytes]:
    """
    A flat dict of numpy arrays as ``(fields, data)``: a JSON list of each field's
    name, dtype and shape, and their bytes one after the other; :func:`unpack` gives
    it back exactly.
    """
    fields = []
    for name, x in flat.items():
        if x.dtype.hasobject or x.dtype.fields is not None:
            raise TypeError(f"field {name} has dtype {x.dtype}, which cannot be sent.")
        # ml_dtypes' types (bfloat16, ...) have a void .str; their name round-trips
        dtype = x.dtype.name if x.dtype.kind == "V" else x.dtype.str
        fields.append([name, dtype, list(x.shape)])
    return json.dumps(fields), b"".join(x.tobytes() for x in flat.values())


def unpack(fields: str, data: bytes) -> dict:
    """The flat dict of numpy arrays that :func:`pack` made ``(fields, data)`` of."""
    offset, flat = 0, {}
    for name, dtype, shape in json.loads(fields):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        flat[name] = np.frombuffer(data, dtype, count, offset).reshape(shape).copy()
        offset += count * dtype.itemsize
    if offset != len(data):
        raise ValueError(f"a packed record holds {len(data) - offset} bytes too many.")
    return flat
