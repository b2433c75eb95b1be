# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
The steps of a loopback round, from a trace of every request
============================================================

Reads the JSON lines that ``sitecustomize.py`` in this directory writes (run
``benchmarks/flower_round.py --variants in-process --trace DIR``, or
``long-lived``) and prints, for each step of one silo's exchange (the ServerApp's
push, the SuperNode's pickup and pulls, the ClientApp worker's pull, step and push
or the node's own ClientApp, the node's push, the ServerApp's pulls and step), its
median and maximum over the rounds and silos. The first two pushes of the
ServerApp (its query of the nodes and round 0, which compiles) are left out.

Run: ``python benchmarks/flower_trace/phases.py DIR``.
"""

import glob
import json
import statistics
import sys

STEPS = (
    "the ServerApp pushes the round's messages",
    "the SuperNode's poll finds its message",
    "the SuperNode pulls the message's objects",
    "its ClientApp worker has the message",
    "the node's own ClientApp (in-process), to its push",
    "the silo step (decode, step, encode)",
    "the worker pushes the reply to its SuperNode",
    "the SuperNode sees the reply (registered)",
    "the SuperNode pushes it to the SuperLink",
    "the ServerApp has the last silo's reply",
    "the server step, to the next round's push",
    "round",
)


def requests(directory):
    """The requests of every process, in time order, and ``{worker pid: node pid}``
    (a worker's ``--runtime-api-address`` is its node's ``--port``)."""
    events = []
    for path in glob.glob(f"{directory}/*.jsonl"):
        with open(path) as f:
            events += [json.loads(line) for line in f]
    ports = {}
    for e in events:
        if e["kind"] == "start":
            for flag in ("--port", "--runtime-api-address"):
                if flag in e["argv"]:
                    port = e["argv"][e["argv"].index(flag) + 1].rsplit(":", 1)[-1]
                    ports.setdefault(port, {})[flag] = e["pid"]
    node_of = {
        p["--runtime-api-address"]: p["--port"] for p in ports.values() if len(p) == 2
    }
    rpcs = sorted((e for e in events if e["kind"] == "rpc"), key=lambda e: e["t0"])
    return rpcs, node_of


def first(events, pid, name, busy=False):
    found = [e for e in events if e["pid"] == pid and e["name"] == name]
    return [e for e in found if e.get("n", 1) > 0] if busy else found


def steps(events, node_of):
    """``{step: [seconds, ...]}`` over the traced rounds and silos."""
    server = [e for e in events if e["role"] == "flwr-serverapp"]
    pushes = [e for e in server if e["name"] == "PushMessages"][2:]
    nodes = sorted({e["pid"] for e in events if e["role"] == "fast_supernode.py"})
    workers = sorted({e["pid"] for e in events if e["role"] == "clientapp_worker.py"})
    out = {step: [] for step in STEPS}
    for push, after in zip(pushes[:-1], pushes[1:], strict=True):
        start = push["t0"]
        window = [e for e in events if start <= e["t0"] < after["t0"]]
        objects = [e["t1"] for e in window if e in server and e["name"] == "PushObject"]
        out[STEPS[0]].append(max(objects + [push["t1"]]) - start)
        last_push = start
        for node in nodes:
            pulled = first(window, node, "PullMessages", busy=True)
            confirmed = first(window, node, "ConfirmMessageReceived")
            pushed = first(window, node, "PushMessages")
            if not (pulled and confirmed and pushed):
                continue
            ends = [e["t1"] for e in first(window, node, "PushObject")]
            end = max(ends + [pushed[0]["t1"]])
            last_push = max(last_push, end)
            # the message's objects are in once the node's last pull of them
            # returns (an in-process node confirms aside, during its push)
            objects = [
                e["t1"]
                for e in first(window, node, "PullObject")
                if e["t1"] <= pushed[0]["t0"]
            ]
            got = max(objects or [confirmed[0]["t1"]])
            out[STEPS[1]].append(pulled[0]["t0"] - start)
            out[STEPS[2]].append(got - pulled[0]["t0"])
            out[STEPS[8]].append(end - pushed[0]["t0"])
            if not [w for w in workers if node_of.get(w) == node]:
                out[STEPS[4]].append(pushed[0]["t0"] - got)
            for worker in [w for w in workers if node_of.get(w) == node]:
                got = first(window, worker, "ConfirmMessageReceived")
                sent = first(window, worker, "PushMessages")
                if got and sent:  # the reply is there once its objects are
                    objects = [e["t1"] for e in first(window, worker, "PushObject")]
                    done = max(objects + [sent[0]["t1"]])
                    out[STEPS[3]].append(got[0]["t1"] - confirmed[0]["t1"])
                    out[STEPS[5]].append(sent[0]["t0"] - got[0]["t1"])
                    out[STEPS[6]].append(done - sent[0]["t0"])
                    # the node pushes a reply it has registered while its objects
                    # still come in
                    out[STEPS[7]].append(pushed[0]["t0"] - sent[0]["t1"])
        replies = [e for e in window if e in server]
        replies = [e for e in replies if e["name"] == "ConfirmMessageReceived"]
        if replies:
            out[STEPS[9]].append(replies[-1]["t1"] - last_push)
            out[STEPS[10]].append(after["t0"] - replies[-1]["t1"])
        out[STEPS[11]].append(after["t0"] - start)
    return out


def main(directory):
    for step, seconds in steps(*requests(directory)).items():
        if seconds:
            print(
                f"{step:48s} n={len(seconds):3d} median {statistics.median(seconds):.3f} s"
                f"  max {max(seconds):.3f} s"
            )


if __name__ == "__main__":
    main(sys.argv[1])
