# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
``flower-supernode`` with a shorter polling interval
===================================================

Flower 1.42's SuperNode asks the SuperLink for a message, and when there is none it
sleeps 3 s before asking again; it waits for its ClientApp's reply (in its own
state, no request) in steps of 0.5 s. Each round a node replies, finds no next
message yet (the server is waiting for the other silos) and sleeps: every round
costs up to 3.5 s more than its work. This runs the same SuperNode with its polls
of the SuperLink capped at ``FLWR_NODE_POLL_INTERVAL`` seconds (default 0.1), at
the cost of more requests to the SuperLink while idle, its waits for the
ClientApp's reply at 0.01 s (a look at its own memory), and its retries of objects
not yet pushed after milliseconds (``quick_pulls.py``).

With ``--in-process`` (and ``--isolation process``) it also runs the ClientApp in
its own process (``inprocess.py``): no ClientApp process, no request between the
node and its ClientApp.

It patches a module of Flower that is not public API (``numpyro-fed[flower]`` pins
``flwr<1.43``); the other arguments are ``flower-supernode``'s::

    python fast_supernode.py --insecure --superlink 127.0.0.1:9092 ...
"""

import os
import sys
import time

from flwr.supernode import start_client_internal
from flwr.supernode.cli import flower_supernode
import inprocess
import quick_pulls

POLL = float(os.environ.get("FLWR_NODE_POLL_INTERVAL", "0.1"))
#: Seconds between looks at the node's own state for the ClientApp's reply.
LOCAL_POLL = 0.01


class _Time:
    """``time`` for the SuperNode's loop, its sleeps capped."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        # Flower sleeps 3 s between requests to the SuperLink, 0.5 s between looks
        # at its own state (the reply, the reply's objects)
        time.sleep(min(seconds, POLL if seconds >= 1 else LOCAL_POLL))


if __name__ == "__main__":
    start_client_internal.time = _Time()
    quick_pulls.install()  # the node pulls the server's messages
    if "--in-process" in sys.argv:
        sys.argv.remove("--in-process")
        inprocess.install()
    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())
