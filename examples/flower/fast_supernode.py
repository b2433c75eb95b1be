# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
``flower-supernode`` with a shorter polling interval
===================================================

Flower 1.42's SuperNode asks the SuperLink for a message, and when there is none it
sleeps 3 s before asking again (and it waits for its ClientApp's reply in steps of
0.5 s). Each round a node replies, finds no next message yet (the server is waiting
for the other silos) and sleeps: every round costs up to 3 s more than its work.
This runs the same SuperNode with those sleeps capped at ``FLWR_NODE_POLL_INTERVAL``
seconds (default 0.1), at the cost of more requests to the SuperLink while idle.

It patches a module of Flower that is not public API (``numpyro-fed[flower]`` pins
``flwr<1.43``); the arguments are ``flower-supernode``'s::

    python fast_supernode.py --insecure --superlink 127.0.0.1:9092 ...
"""

import os
import sys
import time

from flwr.supernode import start_client_internal
from flwr.supernode.cli import flower_supernode

POLL = float(os.environ.get("FLWR_NODE_POLL_INTERVAL", "0.1"))


class _Time:
    """``time`` for the SuperNode's loop, its sleeps capped at ``POLL``."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        time.sleep(min(seconds, POLL))


if __name__ == "__main__":
    start_client_internal.time = _Time()
    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())
