# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Retry Flower's object pulls after milliseconds, not seconds
===========================================================

A Flower 1.42 message travels as a tree of objects (the message, its records, each
array), and a hop is two steps: the sender registers the message, then pushes its
objects one request each. A receiver that polls fast sees the message before all
its objects are there; the object it asks for too early is "not yet available",
and Flower retries it after 1 s, doubling up to 10 s (``PULL_INITIAL_BACKOFF``,
``PULL_BACKOFF_CAP``, bound as defaults when Flower is imported). On loopback that
race is lost on most hops: a SuperNode creates the ClientApp's task before it has
pulled the message's objects, and the server pulls a reply while the node is still
pushing it, so a round waited 1-3 s in these backoffs.

:func:`install` makes this process retry after ``initial`` seconds, doubling up to
``cap``, for as long as Flower's ``PULL_MAX_TIME`` (2 h) allows. Each process that
pulls calls it: ``fast_supernode.py``, ``clientapp_worker.py``, and the app module
(``fedapp.py``) in the ServerApp process when ``NUMPYRO_FED_QUICK_PULLS=1`` is set
(``run_loopback.py`` sets it unless ``--slow-poll``).

It also lets a process push or pull all of a message's objects at once: Flower moves
two at a time, and never more than the machine has cores, though each is a request
that mostly waits for the other process; a message of three objects took two
requests' time on each hop.

It changes defaults of Flower functions that are not public API, which is one
reason ``numpyro-fed[flower]`` pins ``flwr<1.43``; :func:`install` refuses any other
Flower.
"""

import flwr
from flwr.supercore.inflatable import inflatable_utils

#: Objects pushed or pulled at once, per message (Flower's default is 2, and never
#: more than the machine's cores, though a request mostly waits on the other end).
CONCURRENT = 8

#: Seconds before the first retry of an object that is not yet available, and the
#: most between retries.
INITIAL, CAP = 0.01, 0.1


def install(
    initial: float = INITIAL, cap: float = CAP, concurrent: int = CONCURRENT
) -> None:
    """Retry object pulls in this process after ``initial`` s, doubling up to
    ``cap``, and push or pull up to ``concurrent`` objects of a message at once."""
    require_flower_142("quick_pulls.py")
    for pull in (
        inflatable_utils.pull_objects,
        inflatable_utils.pull_and_inflate_object_from_tree,
    ):
        # Keyword-only defaults live in __kwdefaults__, shared by every caller.
        pull.__kwdefaults__.update(
            initial_backoff=initial,
            backoff_cap=cap,
            max_tries_per_object=None,
            max_concurrent_pulls=concurrent,
        )
    for push in (
        inflatable_utils.push_objects,
        inflatable_utils.push_object_contents_from_iterable,
    ):
        push.__kwdefaults__.update(max_concurrent_pushes=concurrent)
    # A message's objects are few and small: one request each, all at once.
    inflatable_utils.get_num_workers = lambda max_concurrent: max_concurrent


def require_flower_142(who: str) -> None:
    """Refuse to patch a Flower other than 1.42 (the internals patched here)."""
    if not flwr.__version__.startswith("1.42."):
        raise RuntimeError(
            f"{who} patches internals of Flower 1.42; this is Flower "
            f"{flwr.__version__}."
        )
