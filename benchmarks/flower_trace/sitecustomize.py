# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
A timestamp on every Flower request, in every process of a deployment
======================================================================

Python imports ``sitecustomize`` at start-up from the first directory on its path
that has one. With this directory on ``PYTHONPATH`` and ``NUMPYRO_FED_TRACE`` naming
a directory, every process of a loopback deployment (SuperLink, SuperExec,
ServerApp, SuperNodes, ClientApps, ``flwr run``) appends one JSON line per
protobuf-over-HTTP request it makes (Flower 1.42's ``ProtobufClient``: the RPC, its
start and end, whether a pulled object was available, how many messages a pull
returned), per ``time.sleep`` of 5 ms or more (where, how long), and its
command line, to
``$NUMPYRO_FED_TRACE/PID.jsonl``. ``phases.py`` reads them. Without the variable it
does nothing; with it every process imports Flower at start-up and runs slower.
"""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("NUMPYRO_FED_TRACE")


def _install(directory):
    role = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    out = open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", buffering=1)
    lock = threading.Lock()

    def log(**event):
        event.update(pid=os.getpid(), role=role)
        with lock:
            out.write(json.dumps(event) + "\n")

    sleep = time.sleep

    def traced_sleep(seconds):
        start = time.time()
        sleep(seconds)
        if seconds >= 0.005:
            frame = sys._getframe(1)
            where = frame.f_code.co_filename.split("site-packages/")[-1]
            log(kind="sleep", name=f"{where}:{frame.f_lineno}", t0=start,
                t1=time.time(), arg=seconds)  # fmt: skip

    log(kind="start", name="argv", t0=time.time(), argv=sys.argv)
    time.sleep = traced_sleep
    from flwr.supercore.protobuf import client

    unary = client.ProtobufClient._unary_unary

    def traced_unary(self, **kwargs):
        start = time.time()
        response = unary(self, **kwargs)
        event = dict(kind="rpc", name=kwargs["rpc_method"].split("/")[-1], t0=start)
        event["t1"] = time.time()
        if hasattr(response, "object_available"):
            event["available"] = bool(response.object_available)
        if hasattr(response, "messages_list"):
            event["n"] = len(response.messages_list)
        log(**event)
        return response

    client.ProtobufClient._unary_unary = traced_unary


if _DIR:
    _install(_DIR)
