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
(``run_loopback.py`` sets it unless ``--slow-poll``). It changes defaults of Flower
functions that are not public API, which is one reason ``numpyro-fed[flower]`` pins
``flwr<1.43``.
"""

from flwr.supercore.inflatable import inflatable_utils

#: Seconds before the first retry of an object that is not yet available, and the
#: most between retries.
INITIAL, CAP = 0.01, 0.1


def install(initial: float = INITIAL, cap: float = CAP) -> None:
    """Retry object pulls in this process after ``initial`` s, doubling up to ``cap``."""
    for pull in (
        inflatable_utils.pull_objects,
        inflatable_utils.pull_and_inflate_object_from_tree,
    ):
        # Keyword-only defaults live in __kwdefaults__, shared by every caller.
        pull.__kwdefaults__.update(
            initial_backoff=initial, backoff_cap=cap, max_tries_per_object=None
        )
