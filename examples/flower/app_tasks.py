# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
What both long-lived ClientApp runners do with a task
=====================================================

``clientapp_worker.py`` (a worker process beside the SuperNode) and ``inprocess.py``
(inside the SuperNode) differ in how a task reaches them, not in how they run it:
the run's app is installed from its FAB and imported once per process, and an app
that raises is answered with an error reply, as ``flwr-clientapp`` answers it.
"""

from flwr.app import Error, Message
from flwr.cli.install import install_from_fab
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode


def run_app(apps: dict, run, fab, message: Message, context) -> Message:
    """The reply of the run's ClientApp to ``message``; the app is installed from
    ``fab`` and imported the first time this process sees the FAB (``apps`` caches
    it by the FAB's hash)."""
    if fab.hash_str not in apps:
        install_from_fab(fab.content, skip_prompt=True)
        load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
    return apps[fab.hash_str](message=message, context=context)


def error_reply(
    error: Exception, message: Message | None
) -> tuple[Message | None, str]:
    """The reply (``None`` when no message was taken) and the task's details for an
    app that raised ``error``, as Flower words them."""
    details = f"{type(error)}:<'{error}'>"
    if message is None:
        return None, details
    reason = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details)
    return Message(reason, reply_to=message), details
