# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Reproduction: XLA:CPU runs the same elementwise work slower on a vmapped layout
===============================================================================

The SFVI round vmaps each silo's ELBO term over J silos, so the GLMM's per-visit
arrays are ``(J, 5, 4)`` (5 children of 4 visits a silo) where the centralized step's
are ``(5000, 4)``: the same 20,000 numbers. This script times one elementwise fusion
(``softplus``, the Bernoulli log-density's costly part) on the same numbers in several
shapes, and the GLMM's Bernoulli log-likelihood with its gradient computed vmapped
over silos and on the units laid end to end, each inside one compiled ``lax.scan``
(no dispatch), interleaved in one process; then a local latent's whole chain
(``numpyro_fed.util.constrain`` says why the library computes it as one axis).

With ``--dump DIR`` it also writes XLA's compiled kernels (``--xla_dump_to``) and,
where ``objdump`` exists, counts the softplus kernel's packed (``...ps``) and scalar
(``...ss``) single-precision vector instructions for each shape: the HLO is the same
for every shape (one loop fusion, same operations), but the machine code for
``(1000, 5, 4)`` is scalar while ``(5000, 4)`` is packed.

Run: ``python benchmarks/xla_cpu_layout.py [--dump /tmp/xla_dump]``.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

SHAPES = [(20000,), (5000, 4), (1000, 20), (1000, 5, 4), (1000, 4, 5), (5, 1000, 4)]


def main(args):
    from _timing import interleaved_times  # benchmarks/ is on sys.path
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro.distributions as dist

    def scanned(f, length=args.scan_length, options=None):
        def many(x):
            return jax.lax.scan(lambda c, _: (f(c), None), x, None, length=length)

        return jax.jit(many, compiler_options=options)

    rng = np.random.default_rng(0)
    flat = jnp.asarray(rng.normal(size=20000), jnp.float32)
    softplus = lambda x: x + 1e-7 * jax.nn.softplus(x)  # noqa: E731
    times = interleaved_times(
        [scanned(softplus)] * len(SHAPES),
        [flat.reshape(s) for s in SHAPES],
        args.repeats,
    )
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("softplus over the same 20,000 float32 numbers, microseconds:")
    for shape, t in zip(SHAPES, times, strict=True):
        print(f"  {str(shape):>14} {1e6 * t / args.scan_length:8.1f}")

    # The GLMM's likelihood and its gradient: vmapped over silos vs end to end.
    J, U, V, P = 1000, 5, 4, 4
    X = jnp.asarray(rng.normal(size=(J * U, V, P)), jnp.float32)
    y = jnp.asarray(rng.uniform(size=(J * U, V)) < 0.5, jnp.float32)
    b = jnp.asarray(rng.normal(size=(J * U, 1)), jnp.float32)
    beta = jnp.asarray(rng.normal(size=(P,)), jnp.float32)

    def likelihood(beta, b, X, y):
        return jnp.sum(dist.Bernoulli(logits=X @ beta + b).log_prob(y))

    grad = jax.value_and_grad(likelihood, argnums=(0, 1))

    def end_to_end(state):
        beta, b = state
        _, (g_beta, g_b) = grad(beta, b, X, y)
        return beta + 1e-6 * g_beta, b + 1e-6 * g_b

    per_silo = (X.reshape(J, U, V, P), y.reshape(J, U, V))

    def vmapped(state):
        beta, b = state
        each = jax.vmap(grad, in_axes=(None, 0, 0, 0))
        _, (g_beta, g_b) = each(beta, b, *per_silo)
        return beta + 1e-6 * g_beta.sum(0), b + 1e-6 * g_b

    t_flat, t_vmap = interleaved_times(
        [scanned(end_to_end), scanned(vmapped)],
        [(beta, b), (beta, b.reshape(J, U, 1))],
        args.repeats,
    )
    print(
        "Bernoulli log-likelihood and gradient, 1000 silos x 5 children x 4 visits: "
        f"end to end {1e6 * t_flat / args.scan_length:.1f} us, vmapped "
        f"{1e6 * t_vmap / args.scan_length:.1f} us ({t_vmap / t_flat:.2f}x)"
    )

    # A local latent's whole chain, as an SFVI silo term computes it: softplus
    # scale, the draw, the GLMM's likelihood and prior, log q (stopped parameters),
    # and the gradient with respect to loc and scale. Parameters kept as (units, 1)
    # against reshaped to (units,) first (the model still reads (units, 1)).
    N = J * U
    eps = jnp.asarray(rng.normal(size=N), jnp.float32)

    def local_elbo(params, flat):
        loc, raw = params
        if flat:
            loc, raw = loc.reshape(-1), raw.reshape(-1)
        scale = jax.nn.softplus(raw)
        z = loc + scale * eps.reshape(loc.shape)
        b = z.reshape(N, 1)
        log_p = likelihood(beta, b, X, y) + jnp.sum(dist.Normal(0, 1).log_prob(b))
        stopped = jax.lax.stop_gradient((loc, scale))
        log_q = jnp.sum(dist.Normal(*stopped).log_prob(z))
        return log_p - log_q

    def chain_step(flat):
        grad_local = jax.grad(local_elbo)

        def step(params):
            g_loc, g_raw = grad_local(params, flat)
            return params[0] + 1e-6 * g_loc, params[1] + 1e-6 * g_raw

        return step

    column = (jnp.zeros((N, 1), jnp.float32), jnp.zeros((N, 1), jnp.float32))
    t_column, t_flat = interleaved_times(
        [scanned(chain_step(False)), scanned(chain_step(True))],
        [column, column],
        args.repeats,
    )
    print(
        "a local latent's chain and its gradient, 5,000 units: as (5000, 1) "
        f"{1e6 * t_column / args.scan_length:.1f} us, reshaped to (5000,) first "
        f"{1e6 * t_flat / args.scan_length:.1f} us"
    )

    # An elementwise operation fused with a reduction (a log density summed over
    # units): jax 0.12's XLA:CPU hands such fusions to YNNPACK, which runs them
    # several times slower over a trailing axis of size 1 (a local latent of a plate
    # at dim=-2 has shape (units, 1)) than over the same numbers as one axis.
    log_sum = lambda x: x + 1e-7 * jnp.sum(jnp.log(x))  # noqa: E731
    scales = jnp.asarray(rng.uniform(1.0, 2.0, size=5000), jnp.float32)
    dots_only = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
    try:
        scanned(log_sum, options=dots_only)(scales)
    except jax.errors.JaxRuntimeError as error:  # another XLA: no such option
        print("YNNPACK fusions: option not available here:", str(error)[:120])
        return
    cases = [(s, o) for s in [(5000,), (5000, 1)] for o in (None, dots_only)]
    times = interleaved_times(
        [scanned(log_sum, options=options) for _, options in cases],
        [scales.reshape(shape) for shape, _ in cases],
        args.repeats,
    )
    print("sum(log x) over 5,000 float32 numbers, microseconds:")
    for (shape, options), t in zip(cases, times, strict=True):
        fusions = "YNNPACK fusions for dots only" if options else "default fusions"
        print(f"  {str(shape):>10} {fusions:>30} {1e6 * t / args.scan_length:8.1f}")


def count_instructions(dump):
    """Packed vs scalar single-precision instructions in each dumped softplus kernel."""
    if shutil.which("objdump") is None:
        print("objdump not found: kernels left in", dump)
        return
    for path in sorted(glob.glob(os.path.join(dump, "*jit_softplus_kernel*.o"))):
        hlo = path.split(".obj-file")[0] + ".cpu_after_optimizations.txt"
        shape = re.search(r"ENTRY .*?: f32\[([\d,]+)\]", open(hlo).read())
        if shape is None:
            continue
        asm = subprocess.run(
            ["objdump", "-d", path], capture_output=True, text=True
        ).stdout
        ops = re.findall(r"\t(v[a-z0-9]+?(ps|ss))\s", asm)
        packed = sum(1 for _, kind in ops if kind == "ps")
        print(
            f"  f32[{shape.group(1)}]: {packed} packed, {len(ops) - packed} scalar "
            "single-precision instructions"
        )


def dump_kernels(dump):
    import jax
    import jax.numpy as jnp

    def softplus_kernel(x):
        return jax.nn.softplus(x)

    for shape in SHAPES:
        jax.jit(softplus_kernel).lower(jnp.zeros(shape)).compile()
    print("compiled softplus kernels (XLA dump in", dump + "):")
    count_instructions(dump)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--scan-length", type=int, default=20)
    parser.add_argument("--dump", help="also dump and inspect XLA's kernels here")
    args = parser.parse_args()
    if args.dump:
        # Before jax starts its backend: XLA reads the flags once.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}"
        )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(args)
    if args.dump:
        dump_kernels(args.dump)
