# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Run the ClientApp inside the SuperNode's own process
====================================================

A Flower 1.42 SuperNode hands each message to a ClientApp in another process over
its Runtime API: the ClientApp polls for a task, pulls the task's input, the message
and each of its objects, confirms, pushes the reply and each of its objects, then
the task's output, about twelve HTTP requests a message, each served by the
SuperNode, plus the wait for the ClientApp's next poll. With :func:`install`, the
SuperNode runs the task itself as soon as it has pulled the message (in its main
loop, as ``flwr-clientapp`` would, with the same node state: the task is claimed,
started and finished, the context stored, the reply put where the SuperNode's push
takes it), so a message costs no request between the node and its ClientApp.

The app is loaded from the run's FAB once per process, like the long-lived worker
(``clientapp_worker.py``), and shares the SuperNode's process, its interpreter and
its lock: a node serves one fit's app this way, the operator's own. The SuperNode
must run with ``--isolation process`` (else its SuperExec would claim the tasks
too) and without a separate worker. Use it through ``fast_supernode.py
--in-process``.

It replaces a function of ``flwr.supernode.start_client_internal`` and calls node
state methods that are not public API; :func:`install` refuses any Flower but 1.42.
"""

import threading

from app_tasks import error_reply, run_app
from flwr.app import Message
from flwr.common.constant import Status, SubStatus
from flwr.supercore.constant import TaskType
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supernode import start_client_internal
import quick_pulls

#: Seconds between the running task's heartbeats (Flower expires a task whose
#: heartbeat is 60 s late; the first message of a run compiles for longer than that
#: on a busy machine).
HEARTBEAT = 10.0

_APPS: dict = {}


def install() -> None:
    """Make this process's SuperNode run each ClientApp task itself."""
    quick_pulls.require_flower_142("inprocess.py")
    pull = start_client_internal._pull_and_store_message
    confirming: list[threading.Thread] = []

    def pull_and_run(**kwargs):
        confirm = kwargs["confirm_message_received"]

        def confirm_aside(run_id, message_id):
            # The receipt only lets the SuperLink drop the message's objects: it
            # need not hold up the ClientApp and the reply's push.
            thread = threading.Thread(target=confirm, args=(run_id, message_id))
            thread.start()
            confirming.append(thread)

        while confirming:  # the last message's receipt is in before the next pull
            confirming.pop().join()
        run_id = pull(**{**kwargs, "confirm_message_received": confirm_aside})
        if run_id is not None:
            run_task(kwargs["state"], kwargs["object_store"], run_id)
        return run_id

    start_client_internal._pull_and_store_message = pull_and_run


def run_task(state, store, run_id: int) -> None:
    """Claim the run's pending ClientApp task and run it here: the message in the
    node's store, the reply into it (as ``flwr-clientapp`` over the Runtime API)."""
    tasks = state.get_tasks(statuses=[Status.PENDING], order_by="pending_at")
    task = next(
        (
            t
            for t in tasks
            if t.run_id == run_id and t.type == TaskType.CLIENT_APP
            if state.claim_task(t.task_id)
        ),
        None,
    )
    if task is None or not state.activate_task(task.task_id):
        return
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    beating = threading.Event()

    def heartbeat():
        while not beating.wait(HEARTBEAT):
            state.acknowledge_task_heartbeat(task.task_id)

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        # the message first: from here on, a failure is replied as an error (the
        # node's loop waits for a reply to every message it pulled)
        message = _take_message(state, store, run_id)
        run = state.get_run(run_id)
        context = state.get_run_series_context(run.series_id)
        reply = run_app(_APPS, run, state.get_fab(run.fab_hash), message, context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as error:  # noqa: BLE001 - the reply carries it, as in Flower
        reply, details = error_reply(error, message)
    finally:
        beating.set()
        if reply is not None and message is not None:
            state.record_message_processing_end(message.metadata.message_id)
            # Flower's own way to put a reply made on the node (its FAB check's)
            start_client_internal._insert_message(reply, state, store)
        state.finish_task(task.task_id, sub_status=status, details=details)
        if context is not None:
            state.set_run_series_context(run.series_id, context)


def _take_message(state, store, run_id: int) -> Message:
    """The run's message for the ClientApp, inflated from the node's object store,
    and its objects released (the Runtime API's PullMessages, PullObject and
    ConfirmMessageReceived)."""
    (message,) = state.get_messages_legacy(run_ids=[run_id], is_reply=False, limit=1)
    message_id = message.metadata.message_id
    state.record_message_processing_start(message_id=message_id)
    tree = store.get_object_tree(message_id)
    contents = {t.object_id: store.get(t.object_id) for t in iterate_object_tree(tree)}
    inflated = inflate_object_from_contents(message_id, contents)
    if not isinstance(inflated, Message):
        raise TypeError(f"object {message_id} of run {run_id} is not a message.")
    inflated.metadata.__dict__["_message_id"] = message_id
    store.delete(message_id)
    return inflated
