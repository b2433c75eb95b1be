# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The codec: every state and message of every algorithm survives encode/decode
exactly, and a flat dict that does not match its template is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.runtime.codec import TemplateMismatch, decode, encode, fingerprint
from tests.algorithms.test_contract import CASES


def _equal(a, b):
    def same(x, y):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        return x.dtype == y.dtype and x.shape == y.shape and bool(jnp.all(x == y))

    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        jax.tree.leaves(jax.tree.map(same, a, b))
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_states_and_messages_round_trip_exactly(name):
    case = CASES[name]()
    alg = case.algorithm
    server = alg.init_server(jax.random.key(0))
    message = alg.server_message(server, case.server_key)
    for tree in (server, message, case.server_key, case.silo_keys):
        template = jax.eval_shape(lambda t=tree: t)
        assert _equal(decode(encode(tree), template), tree)


def test_float64_and_typed_keys_survive():
    with jax.enable_x64(True):
        tree = {"x": jnp.arange(3.0), "key": jax.random.key(3), "n": jnp.int64(2**40)}
        back = decode(encode(tree), tree)
        assert back["x"].dtype == jnp.float64 and int(back["n"]) == 2**40
        assert _equal(back, tree)


def test_a_mismatched_dict_is_refused_by_field():
    template = {"theta": {"a": jnp.zeros(2)}, "eps": jnp.zeros((3,), jnp.float32)}
    flat = encode(template)
    with pytest.raises(TemplateMismatch, match=r"node 7: field \['eps'\] is float32\[4\]"):
        decode({**flat, "['eps']": np.zeros(4, np.float32)}, template, source="node 7")
    with pytest.raises(TemplateMismatch, match=r"float64\[3\], expected float32\[3\]"):
        decode({**flat, "['eps']": np.zeros(3)}, template)
    with pytest.raises(TemplateMismatch, match=r"lacks field \['theta'\]\['a'\]"):
        decode({"['eps']": flat["['eps']"]}, template)
    with pytest.raises(TemplateMismatch, match=r"extra field \['z'\]"):
        decode({**flat, "['z']": np.zeros(1)}, template)
    assert fingerprint(template) != fingerprint({**template, "z": jnp.zeros(1)})
