# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""ArviZ conversion and side-by-side comparison against NUTS or an exact posterior."""

from typing import Any, Mapping

import numpy as np
import numpyro.distributions as dist
import pandas as pd

__all__ = ["compare", "format_compare", "to_arviz"]


def _is_mcmc(obj: Any) -> bool:
    from numpyro.infer import MCMC

    return isinstance(obj, MCMC)


def to_arviz(samples: Any, *, num_chains: int | None = None, dims=None, coords=None):
    """
    Convert posterior draws to an ArviZ 1.x ``xarray.DataTree``.

    :param samples: a dict site -> draws (leading draw axis), a ``numpyro.infer.MCMC``
        or a ``DataTree`` (returned unchanged). Sites starting with ``_`` are skipped.
    :param int num_chains: split the leading axis into ``(chains, draws)``.
    :param dict dims: ArviZ dims per site, e.g. ``{"b": ["child"]}``.
    :param dict coords: ArviZ coords.
    :return: the ArviZ data.

    **Example:**

    .. doctest::

        >>> import numpy as np, numpyro_fed as nf
        >>> idata = nf.to_arviz({"mu": np.zeros(100)})
        >>> dict(idata.posterior.sizes)
        {'chain': 1, 'draw': 100}
    """
    import arviz as az

    if _is_mcmc(samples):
        return az.from_numpyro(samples, dims=dims, coords=coords)
    if not isinstance(samples, Mapping):
        return samples
    posterior = {}
    for name, value in samples.items():
        if name.startswith("_"):
            continue
        value = np.asarray(value)
        if value.ndim == 0:
            raise ValueError(f"Site {name!r} has no draw axis (a scalar).")
        if num_chains is None:
            value = value[None]
        else:
            if value.shape[0] % num_chains:
                raise ValueError(
                    f"Site {name!r} has {value.shape[0]} draws, not divisible by "
                    f"num_chains={num_chains}."
                )
            value = value.reshape((num_chains, -1) + value.shape[1:])
        posterior[name] = value
    return az.from_dict({"posterior": posterior}, dims=dims, coords=coords)


def _draws(source: Any) -> dict[str, np.ndarray]:
    """Site -> draws flattened over chains, shape (draws, ...)."""
    if isinstance(source, Mapping) and all(
        isinstance(v, dist.Distribution) for v in source.values()
    ):
        return dict(source)
    if _is_mcmc(source):
        return {k: np.asarray(v) for k, v in source.get_samples().items()}
    if isinstance(source, Mapping):
        return {k: np.asarray(v) for k, v in source.items() if not k.startswith("_")}
    posterior = source["posterior"] if "posterior" in source.children else source
    out = {}
    for name, var in posterior.data_vars.items():
        value = np.asarray(var.values)
        out[name] = value.reshape((-1,) + value.shape[2:])
    return out


def _labels(name: str, shape: tuple) -> list[str]:
    if not shape:
        return [name]
    return [f"{name}[{','.join(map(str, idx))}]" for idx in np.ndindex(*shape)]


def _w2_samples(a: np.ndarray, b: np.ndarray) -> float:
    n = max(len(a), len(b))
    q = np.linspace(0.5 / n, 1 - 0.5 / n, n)
    return float(np.sqrt(np.mean((np.quantile(a, q) - np.quantile(b, q)) ** 2)))


def compare(
    fed: Any,
    reference: Any,
    *,
    var_names: list[str] | None = None,
    labels: tuple[str, str] = ("fed", "reference"),
) -> pd.DataFrame:
    """
    Side-by-side posterior marginals of a federated fit and a reference.

    :param fed: draws (dict, ``MCMC`` or ``DataTree``).
    :param reference: the same kinds, or a dict site -> numpyro ``Distribution`` (an
        exact posterior marginal): its mean and standard deviation are used.
    :param list var_names: sites to compare (default: all shared sites).
    :param tuple labels: column suffixes for the two sides.
    :return: one row per scalar coordinate with means, sds, ``mean_diff_sd`` (mean
        difference in reference sds), ``sd_ratio`` and ``w2`` (1-D 2-Wasserstein
        distance: empirical between draws, Gaussian closed form against a
        distribution). ``df.attrs`` holds ``max_abs_mean_diff_sd`` and ``max_w2``.

    **Example:**

    .. doctest::

        >>> import numpy as np, numpyro.distributions as dist, numpyro_fed as nf
        >>> draws = {"mu": np.random.default_rng(0).normal(1.0, 2.0, 4000)}
        >>> table = nf.compare(draws, {"mu": dist.Normal(1.0, 2.0)})
        >>> abs(table.loc["mu", "mean_diff_sd"]) < 0.1
        True
    """
    a, b = _draws(fed), _draws(reference)
    shared = [k for k in a if k in b]
    if var_names is not None:
        unknown = [k for k in var_names if k not in shared]
        if unknown:
            raise ValueError(f"Sites {unknown} are not in both posteriors (shared: {shared}).")
        shared = list(var_names)
    if not shared:
        raise ValueError("The two posteriors share no site.")
    la, lb = labels
    rows = {}
    for name in shared:
        x = a[name]
        shape = x.shape[1:]
        x = x.reshape(len(x), -1)
        ref = b[name]
        if isinstance(ref, dist.Distribution):
            ref_mean = np.broadcast_to(np.asarray(ref.mean), shape).reshape(-1)
            ref_sd = np.broadcast_to(np.sqrt(np.asarray(ref.variance)), shape).reshape(-1)
            ref_draws = None
        else:
            ref_draws = ref.reshape(len(ref), -1)
            ref_mean, ref_sd = ref_draws.mean(0), ref_draws.std(0, ddof=1)
        mean, sd = x.mean(0), x.std(0, ddof=1)
        for i, label in enumerate(_labels(name, shape)):
            if ref_draws is None:
                w2 = float(np.hypot(mean[i] - ref_mean[i], sd[i] - ref_sd[i]))
            else:
                w2 = _w2_samples(x[:, i], ref_draws[:, i])
            rows[label] = {
                f"mean_{la}": mean[i], f"mean_{lb}": ref_mean[i],
                f"sd_{la}": sd[i], f"sd_{lb}": ref_sd[i],
                "mean_diff_sd": (mean[i] - ref_mean[i]) / ref_sd[i],
                "sd_ratio": sd[i] / ref_sd[i],
                "w2": w2,
            }
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.attrs["max_abs_mean_diff_sd"] = float(df["mean_diff_sd"].abs().max())
    df.attrs["max_w2"] = float(df["w2"].max())
    return df


def format_compare(df: pd.DataFrame, digits: int = 3) -> str:
    """A printable version of a :func:`compare` table."""
    return df.round(digits).to_string()
