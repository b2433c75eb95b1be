# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Per-silo terms + server term = pooled log joint, with and without padding."""

import jax
import numpy as np
from numpyro import handlers
from numpyro.infer.util import log_density
import pytest

import numpyro_fed as nf
from numpyro_fed.densities import data_template
from tests import _models as m

CASES = {
    "hierarchical": ("group", m.hierarchical, m.hierarchical_data),
    "logistic": ("data", m.logistic, m.logistic_data),
    "glmm": ("child", m.glmm, m.glmm_data),
}


@pytest.mark.parametrize("pad_to", [None, 20], ids=["unpadded", "padded"])
@pytest.mark.parametrize("num_silos", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_silo_terms_sum_to_pooled_log_joint(name, num_silos, pad_to):
    plate, model, make = CASES[name]
    fed = nf.federate(model, silos=plate)
    arrays = make()
    units = next(iter(arrays.values())).shape[0]
    data = nf.FederatedData.from_groups(
        m.split_groups(units, num_silos),
        pad_to=max(pad_to or 0, units) if pad_to else None,
        **arrays,
    )
    roles = nf.partition.analyze(fed, data)
    # One joint draw from the prior of the pooled model (values and params).
    pooled = data.pooled()
    tr = handlers.trace(handlers.seed(fed, jax.random.key(5))).get_trace(**pooled)
    values = {
        k: s["value"]
        for k, s in tr.items()
        if s["type"] == "param" or (s["type"] == "sample" and not s["is_observed"])
    }
    expected, _ = log_density(fed, (), pooled, values)

    server = nf.densities.server_log_density(fed, plate, data_template(data.silo(0)), values)
    total = server
    for j in range(data.num_silos):
        silo_values = dict(values)
        for site in roles.local_sites:  # this silo's units of each local site
            stacked = data.scatter_units(values[site])
            silo_values[site] = stacked[j]
        arrays_j = {k: v[j] for k, v in data.arrays.items()}
        total = total + nf.densities.silo_log_density(
            fed, plate, arrays_j, data.mask[j], silo_values
        )
    np.testing.assert_allclose(total, expected, rtol=1e-12)
