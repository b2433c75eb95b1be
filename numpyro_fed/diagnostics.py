# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""ArviZ conversion and side-by-side comparison against NUTS or an exact posterior."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard
import warnings

import numpy as np
import numpyro.distributions as dist
from numpyro.infer import MCMC
import pandas as pd

if TYPE_CHECKING:
    import xarray

__all__ = ["compare", "format_compare", "to_arviz"]


def _is_datatree(obj: Any) -> TypeGuard[xarray.DataTree]:
    # xarray is imported lazily (ArviZ and xarray add seconds to ``import numpyro_fed``).
    import xarray

    return isinstance(obj, xarray.DataTree)


def _check_draws(samples: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Site -> ``np.ndarray`` with a leading draw axis, skipping ``_``-prefixed sites."""
    out: dict[str, np.ndarray] = {}
    num_draws, first = None, None
    for name, value in samples.items():
        if isinstance(name, str) and name.startswith("_"):
            continue
        if isinstance(value, dist.Distribution):
            raise TypeError(
                f"Site {name!r} is a Distribution; draws (an array) are needed here."
            )
        value = np.asarray(value)
        if value.ndim == 0:
            raise ValueError(
                f"Site {name!r} has no draw axis (a 0-d value); expected an array of "
                "shape (draws, ...)."
            )
        if num_draws is None:
            num_draws, first = value.shape[0], name
        elif value.shape[0] != num_draws:
            raise ValueError(
                f"Site {name!r} has {value.shape[0]} draws but site {first!r} has "
                f"{num_draws}."
            )
        out[name] = value
    if not out:
        raise ValueError("No sites to convert (sites starting with '_' are skipped).")
    return out


def to_arviz(
    samples: Mapping[str, Any] | MCMC | xarray.DataTree,
    *,
    num_chains: int | None = None,
    dims: Mapping[str, Sequence[str]] | None = None,
    coords: Mapping[str, Any] | None = None,
) -> xarray.DataTree:
    """
    Convert posterior draws to an ArviZ 1.x ``xarray.DataTree``.

    :param samples: a dict site name -> draws of shape ``(draws, ...)`` (sites whose
        name starts with ``_`` are skipped), a ``numpyro.infer.MCMC`` (converted with
        ``arviz.from_numpyro``; the chains of an :class:`~numpyro_fed.FSGLD` or
        :class:`~numpyro_fed.DSGLD` kernel are checked by
        :func:`~numpyro_fed.sgld_diagnostics.warn_low_ess`, here and in
        :func:`compare`) or a ``DataTree`` (returned unchanged).
    :type samples: dict, ~numpyro.infer.MCMC or xarray.DataTree
    :param int num_chains: for dict draws only: split the leading axis of
        ``chains * draws`` into ``(num_chains, draws)``, chain by chain as in
        ``MCMC.get_samples()``. By default the draws form one chain.
    :param dict dims: ArviZ dimension names per site, e.g. ``{"b": ["child"]}``.
    :param dict coords: ArviZ coordinate values per dimension name.
    :return: the ArviZ data, with a ``posterior`` group of dims ``(chain, draw, ...)``.
    :rtype: xarray.DataTree

    **Example:**

    .. doctest::

        >>> import numpy as np, numpyro_fed as nf
        >>> idata = nf.to_arviz({"mu": np.zeros(100)}, num_chains=4)
        >>> dict(idata.posterior.sizes)
        {'chain': 4, 'draw': 25}
    """
    extra = num_chains is not None or dims is not None or coords is not None
    if _is_datatree(samples):
        if extra:
            raise ValueError("num_chains, dims and coords do not apply to a DataTree.")
        return samples
    if isinstance(samples, MCMC):
        if num_chains is not None:
            raise ValueError("num_chains does not apply to an MCMC (it knows its own).")
        import arviz as az

        _check_sgld_chains(samples)
        return az.from_numpyro(samples, dims=dims, coords=coords)
    if not isinstance(samples, Mapping):
        raise TypeError(
            "samples must be a dict of draws, a numpyro MCMC or an xarray.DataTree, "
            f"not {type(samples).__name__}."
        )
    import xarray

    if isinstance(samples, xarray.Dataset):
        raise TypeError("Pass an xarray.DataTree (e.g. from arviz), not a Dataset.")
    draws = _check_draws(samples)
    if num_chains is None:
        posterior = {k: v[None] for k, v in draws.items()}
    else:
        if (
            isinstance(num_chains, bool)
            or int(num_chains) != num_chains
            or num_chains < 1
        ):
            raise ValueError(
                f"num_chains must be a positive integer, got {num_chains!r}."
            )
        num_chains = int(num_chains)
        posterior = {}
        for name, value in draws.items():
            if value.shape[0] % num_chains:
                raise ValueError(
                    f"Site {name!r} has {value.shape[0]} draws, which num_chains="
                    f"{num_chains} does not divide."
                )
            posterior[name] = value.reshape((num_chains, -1) + value.shape[1:])
    import arviz as az

    return az.from_dict({"posterior": posterior}, dims=dims, coords=coords)


def _check_sgld_chains(mcmc: MCMC) -> None:
    """Warn when the chains of a federated SGLD kernel diverged or are too short for
    their means to be trusted (:func:`~numpyro_fed.sgld_diagnostics.warn_low_ess`,
    which reads the divergences off ``mcmc.last_state``): NumPyro's ``MCMC`` gives a
    kernel no hook that sees the whole chain, so the draws are checked where they
    are read."""
    from numpyro_fed.infer.mcmc import FSGLD
    from numpyro_fed.sgld_diagnostics import warn_low_ess

    if isinstance(mcmc.sampler, FSGLD):  # DSGLD is one too
        warn_low_ess(mcmc, name=type(mcmc.sampler).__name__)


def _pooled(source: Any, side: str) -> dict[str, np.ndarray | dist.Distribution]:
    """Site -> draws pooled over chains, shape ``(draws, ...)``, or a Distribution."""
    if _is_datatree(source):
        node = source["posterior"] if "posterior" in source.children else source
        out = {}
        for name, var in node.data_vars.items():
            if str(name).startswith("_"):
                continue
            if "chain" not in var.dims or "draw" not in var.dims:
                raise ValueError(
                    f"{side}: variable {name!r} has dims {var.dims}, without "
                    "('chain', 'draw')."
                )
            value = np.asarray(var.transpose("chain", "draw", ...).values)
            out[str(name)] = value.reshape((-1,) + value.shape[2:])
        return out
    if isinstance(source, MCMC):
        _check_sgld_chains(source)
        return _check_draws(source.get_samples())
    if isinstance(source, dist.Distribution):
        raise TypeError(f"{side}: pass a dict site name -> Distribution.")
    if not isinstance(source, Mapping):
        raise TypeError(
            f"{side}: expected a dict, a numpyro MCMC or an xarray.DataTree, "
            f"not {type(source).__name__}."
        )
    distributions = {
        k: v for k, v in source.items() if isinstance(v, dist.Distribution)
    }
    if distributions and side == "fed":
        raise TypeError(
            f"fed: sites {list(distributions)} are Distributions, not draws."
        )
    rest = {
        k: v
        for k, v in source.items()
        if k not in distributions and not str(k).startswith("_")
    }
    return {**(_check_draws(rest) if rest else {}), **distributions}


def _labels(name: str, shape: tuple[int, ...]) -> list[str]:
    if not shape:
        return [name]
    return [f"{name}[{','.join(map(str, idx))}]" for idx in np.ndindex(*shape)]


def _w2_empirical(a: np.ndarray, b: np.ndarray) -> float:
    """Exact 2-Wasserstein distance between the empirical measures of 1-D draws.

    Both quantile functions are step functions, with steps at ``i / n`` and
    ``j / m``; on the merged grid (integers in units of ``1 / (n m)``) they are
    constant, so the integral of their squared difference is an exact sum. For
    ``n == m`` this is ``sqrt(mean((sort(a) - sort(b)) ** 2))``.
    """
    a, b = np.sort(a), np.sort(b)
    n, m = len(a), len(b)
    steps = np.union1d(np.arange(n) * m, np.arange(m) * n)
    weights = np.diff(np.append(steps, n * m)) / (n * m)
    return float(np.sqrt(np.sum(weights * (a[steps // m] - b[steps // n]) ** 2)))


def _reference_moments(
    name: str, ref: dist.Distribution, shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    ref_shape = tuple(ref.batch_shape) + tuple(ref.event_shape)
    if ref_shape != shape:
        raise ValueError(
            f"Site {name!r}: the reference distribution has shape {ref_shape} but the "
            f"draws have shape {shape} (use .expand() or .to_event() to match)."
        )
    try:
        mean, var = np.asarray(ref.mean), np.asarray(ref.variance)
    except NotImplementedError as e:
        raise ValueError(f"Site {name!r}: the reference has no mean/variance.") from e
    return (
        np.broadcast_to(mean, shape).reshape(-1),
        np.sqrt(np.broadcast_to(var, shape)).reshape(-1),
    )


def compare(
    fed: Mapping[str, Any] | MCMC | xarray.DataTree,
    reference: Mapping[str, Any] | MCMC | xarray.DataTree,
    *,
    var_names: Sequence[str] | None = None,
    labels: tuple[str, str] = ("fed", "reference"),
    joint: bool = False,
) -> pd.DataFrame:
    """
    Side-by-side posterior marginals of a federated fit and a reference.

    Means and standard deviations (``ddof=1``, as in ``arviz.summary``) pool all chains
    and draws. Multi-dimensional sites are flattened in C order into rows such as
    ``b[3,1]``.

    :param fed: draws, in any form :func:`to_arviz` accepts.
    :param reference: the same kinds, or a dict site name -> numpyro ``Distribution``
        (an exact posterior marginal or joint, whose ``batch_shape + event_shape`` is
        the site's shape): its ``mean`` and ``variance`` are used.
    :param list var_names: sites to compare (default: every site in both).
    :param tuple labels: column suffixes for the two sides.
    :param bool joint: also compare the joint distributions, which marginal rows
        miss (a correlation of the wrong sign has the right marginals): the
        debiased Sinkhorn divergence (ott-jax, squared Euclidean cost) between the
        two sets of draws of every compared coordinate, each standardized by the
        reference's mean and sd, in ``df.attrs["sinkhorn_divergence"]``. It is 0
        for equal draw sets and about ``d**2`` for a shift of ``d`` reference sds
        (it approximates the squared 2-Wasserstein distance). Needs draws on both
        sides and ``pip install 'numpyro-fed[diagnostics]'``; at most
        4,000 evenly thinned draws per side are used.
    :return: one row per scalar coordinate with columns ``mean_<label>``,
        ``sd_<label>``, ``mean_diff_sd`` (``(mean_fed - mean_ref) / sd_ref``),
        ``sd_ratio`` (``sd_fed / sd_ref``) and ``w2``, the 1-D 2-Wasserstein distance
        between the marginals: exact between two sets of draws, and the Gaussian
        closed form ``sqrt((m1 - m2)**2 + (s1 - s2)**2)`` against a Distribution.
        ``df.attrs`` holds ``max_abs_mean_diff_sd`` and ``max_w2`` (and
        ``sinkhorn_divergence`` with ``joint=True``).
    :rtype: pandas.DataFrame

    **Example:**

    .. doctest::

        >>> import numpy as np, numpyro.distributions as dist, numpyro_fed as nf
        >>> draws = {"mu": np.random.default_rng(0).normal(1.0, 2.0, 4000)}
        >>> table = nf.compare(draws, {"mu": dist.Normal(1.0, 2.0)})
        >>> bool(abs(table.loc["mu", "mean_diff_sd"]) < 0.1)
        True
    """
    if len(labels) != 2 or labels[0] == labels[1]:
        raise ValueError(f"labels must be two distinct names, got {labels!r}.")
    a, b = _pooled(fed, "fed"), _pooled(reference, "reference")
    shared = [k for k in a if k in b]
    if var_names is not None:
        var_names = [var_names] if isinstance(var_names, str) else list(var_names)
        unknown = [k for k in var_names if k not in shared]
        if unknown:
            raise ValueError(
                f"var_names {unknown} are not in both posteriors: fed has {list(a)}, "
                f"reference has {list(b)}."
            )
        shared = var_names
    if not shared:
        raise ValueError(
            f"The two posteriors share no site: fed has {list(a)}, reference has "
            f"{list(b)}."
        )
    la, lb = labels
    rows: dict[str, dict[str, float]] = {}
    standardized: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for name in shared:
        x, ref = a[name], b[name]
        shape = x.shape[1:]
        x = x.reshape(len(x), -1).astype(float)
        mean, sd = x.mean(0), x.std(0, ddof=1)
        if isinstance(ref, dist.Distribution):
            ref_mean, ref_sd = _reference_moments(name, ref, shape)
            y = None
        else:
            if ref.shape[1:] != shape:
                raise ValueError(
                    f"Site {name!r} has shape {shape} in fed but {ref.shape[1:]} in "
                    "reference."
                )
            y = ref.reshape(len(ref), -1).astype(float)
            ref_mean, ref_sd = y.mean(0), y.std(0, ddof=1)
            if joint:
                unit = np.where(ref_sd > 0, ref_sd, 1.0)  # a constant coordinate: as is
                standardized[0].append((x - ref_mean) / unit)
                standardized[1].append((y - ref_mean) / unit)
        if joint and y is None:
            raise ValueError(
                f"compare(joint=True) needs draws of site {name!r} on both sides, "
                "not a Distribution: sample the reference first."
            )
        with np.errstate(divide="ignore", invalid="ignore"):
            diff_sd, ratio = (mean - ref_mean) / ref_sd, sd / ref_sd
        for i, label in enumerate(_labels(name, shape)):
            if y is None:
                w2 = float(np.hypot(mean[i] - ref_mean[i], sd[i] - ref_sd[i]))
            else:
                w2 = _w2_empirical(x[:, i], y[:, i])
            rows[label] = {
                f"mean_{la}": float(mean[i]),
                f"mean_{lb}": float(ref_mean[i]),
                f"sd_{la}": float(sd[i]),
                f"sd_{lb}": float(ref_sd[i]),
                "mean_diff_sd": float(diff_sd[i]),
                "sd_ratio": float(ratio[i]),
                "w2": w2,
            }
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.attrs["max_abs_mean_diff_sd"] = float(df["mean_diff_sd"].abs().max())
    df.attrs["max_w2"] = float(df["w2"].max())
    if joint:
        fed_draws, ref_draws = (np.concatenate(cols, axis=1) for cols in standardized)
        df.attrs["sinkhorn_divergence"] = _sinkhorn_divergence(fed_draws, ref_draws)
    return df


#: Draws per side that compare(joint=True) keeps (its cost grows as their product).
_JOINT_MAX_DRAWS = 4000


def _sinkhorn_divergence(x: np.ndarray, y: np.ndarray) -> float:
    """Debiased Sinkhorn divergence (squared Euclidean cost, ott-jax's default
    relative epsilon) between the empirical measures of the rows of ``x`` and
    ``y``, each thinned evenly to at most :data:`_JOINT_MAX_DRAWS` rows."""
    try:
        from ott.geometry import pointcloud
        from ott.tools.sinkhorn_divergence import sinkhorn_divergence
    except ImportError as err:
        raise ImportError(
            "compare(joint=True) needs ott-jax: pip install 'numpyro-fed[diagnostics]'."
        ) from err
    import jax.numpy as jnp

    def thin(z: np.ndarray) -> jnp.ndarray:
        return jnp.asarray(z[:: -(-len(z) // _JOINT_MAX_DRAWS)])

    divergence, out = sinkhorn_divergence(pointcloud.PointCloud, thin(x), thin(y))
    if not all(bool(c) for c in out.converged):
        warnings.warn(
            "compare(joint=True): Sinkhorn did not converge; the divergence is "
            "approximate.",
            stacklevel=3,
        )
    return float(divergence)


def format_compare(df: pd.DataFrame, digits: int = 3) -> str:
    """
    A printable version of a :func:`compare` table.

    :param pandas.DataFrame df: the table returned by :func:`compare`.
    :param int digits: decimals to round to.
    :return: the rounded table as text.
    :rtype: str

    **Example:**

    .. doctest::

        >>> import numpy as np, numpyro_fed as nf
        >>> draws = {"mu": np.arange(4.0)}
        >>> print(nf.format_compare(nf.compare(draws, draws), digits=2))
            mean_fed  mean_reference  sd_fed  sd_reference  mean_diff_sd  sd_ratio   w2
        mu       1.5             1.5    1.29          1.29           0.0       1.0  0.0
    """
    return df.round(digits).to_string()
