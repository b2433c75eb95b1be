# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
A long-lived ClientApp process for a Flower 1.42 SuperNode
=========================================================

By default a SuperNode's SuperExec starts a new ``flwr-clientapp`` process for every
message: each round, every node starts Python, imports Flower, JAX and NumPyro,
builds the federation and compiles the silo step again (seconds per round). A
SuperNode started with ``--isolation process`` leaves that to a process of our
choosing; this one takes the node's tasks from its Runtime API and runs each in
itself, so the app module is imported once, and numpyro-fed's per-process caches
(the federation, the silo and its compiled step) last for the whole run.

Run it next to its SuperNode, with the SuperNode's ``--port``::

    flower-supernode --insecure --isolation process --port 9094 ...
    python clientapp_worker.py --runtime-api-address 127.0.0.1:9094 --insecure

It follows ``flwr.supernode.runtime.run_clientapp`` (Flower 1.42) task by task,
without exiting after one; it uses Flower modules that are not public API, which is
why ``numpyro-fed[flower]`` pins ``flwr<1.43``.
"""

import argparse
import os
import time

from app_tasks import error_reply, run_app
from flwr.common.constant import SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)
import quick_pulls


def _client(address, insecure, *interceptors):
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=None,
        interceptors=list(interceptors),
        retry_invoker=make_simple_http_retry_invoker(),
    )


def run_task(address, insecure, token, apps):
    """One ClientApp task, as ``flwr-clientapp --token`` runs it, in this process."""
    client = _client(
        address,
        insecure,
        RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
        RuntimeTokenHttpInterceptor(token),
    )
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        message, context, run, fab = pull_task_input(client)
        reply = run_app(apps, run, fab, message, context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as error:  # noqa: BLE001 - the reply carries it, as in Flower
        reply, details = error_reply(error, message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client, context, status, details)
        finally:
            heartbeat.stop()
            client.close()


def main(args):
    address, insecure = args.runtime_api_address, args.insecure
    acquire = _client(
        address, insecure, RuntimeVersionHttpInterceptor(component_name="SuperExec")
    )
    apps = {}
    while True:
        res = acquire.AcquireTask(
            AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        )
        if res.HasField("task") and res.token:
            run_task(address, insecure, res.token, apps)
        else:
            time.sleep(args.poll)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A long-lived ClientApp process")
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--insecure", action="store_true")
    parser.add_argument("--poll", type=float, default=0.1, help="seconds")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    # the node creates our task before it has pulled the message's objects
    quick_pulls.install()
    main(parser.parse_args())
