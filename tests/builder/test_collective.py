"""The build group's gather (real gloo ranks) and the collector pause around its unpickling."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import subprocess
import sys
import threading

import pytest

from build_fixtures import free_port
from tokenloom.builder.collective import collector_paused

RANK_SCRIPT = r"""
import gc, hashlib, json, pickle, sys
from datetime import timedelta
import torch.distributed as dist
from tokenloom.builder.collective import TorchGroup
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
try:
    group = TorchGroup(timeout_s=60)
    # payloads of very different sizes per rank, one rank's far larger than the rest; the first
    # round carries SLOT_BYTES of each, longer ones go whole by gather and broadcast up to
    # TREE_WIDTH_BYTES and by the ring beyond it (the last: 2.2 MB times ceil(log2(3)) > 4 MiB)
    payloads = [None, rank, "x" * (rank * 70_001), {"r": rank, "items": list(range(rank * 5000))},
                b"\x00" * (100_000 if rank == 1 else 1), b"\x01" * (2_200_001 if rank == 2 else 1017)]
    got = [group.all_gather_object(p) for p in payloads]
    gc.disable()  # a caller that turned the collector off keeps it off
    group.all_gather_object(rank)
    still_off = not gc.isenabled()
    gc.enable()
    out = {"got": [[hashlib.sha256(pickle.dumps(x)).hexdigest() for x in g] for g in got], "still_off": still_off,
           "enabled_after": gc.isenabled(), "calls": group.traffic.calls}
    print(json.dumps(out), flush=True)
    group.close()
finally:
    dist.destroy_process_group()
"""


def test_the_gather_returns_every_ranks_object_whatever_their_sizes():
    pytest.importorskip("torch.distributed")
    world, port = 3, free_port()
    env = dict(os.environ)
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(world), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    expected = [[None, r, "x" * (r * 70_001), {"r": r, "items": list(range(r * 5000))},
                 b"\x00" * (100_000 if r == 1 else 1), b"\x01" * (2_200_001 if r == 2 else 1017)]
                for r in range(world)]
    want = [[hashlib.sha256(pickle.dumps(expected[r][i])).hexdigest() for r in range(world)] for i in range(6)]
    for out in outs:
        assert out["got"] == want
        assert out["still_off"] and out["enabled_after"]
        assert out["calls"] == 7


def test_the_collector_comes_back_only_when_the_last_thread_leaves():
    assert gc.isenabled()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with collector_paused():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with collector_paused():
            second_in.set()
            first_out.wait(10)
            seen["after_first_left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after_first_left": False}
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


class _BrokenGroup:
    """A group whose gather fails as gloo does: a timeout, or a peer's closed connection."""

    rank = 1
    timeout_s = 60.0

    def __init__(self, message: str) -> None:
        self.message = message

    def all_gather_object(self, obj):
        raise RuntimeError(self.message)


def test_a_broken_gather_names_a_timeout_only_when_it_timed_out():
    from tokenloom.builder.collective import gather
    from tokenloom.errors import BuildError

    timed_out = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv operation to complete"
    with pytest.raises(BuildError) as info:
        gather(_BrokenGroup(timed_out), None, phase="build")
    message = str(info.value)
    assert message.startswith("The other ranks did not answer in the build phase within 60 s") and "[rank 1]" in message
    assert "Timed out waiting 60000ms" in message and "killed or hung" in message

    closed = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:11957. This is typically..."
    with pytest.raises(BuildError) as info:
        gather(_BrokenGroup(closed), None, phase="finalize")
    message = str(info.value)
    assert message.startswith("The build's group broke in the finalize phase (a peer's connection closed)")
    assert "within 60 s" not in message and "Connection closed by peer" in message and "killed or hung" in message

    with pytest.raises(BuildError) as info:
        gather(_BrokenGroup("unexpected failure"), None, phase="plan")
    message = str(info.value)
    assert message.startswith("The build's gather failed in the plan phase (RuntimeError: unexpected failure)")


RELEASE_SCRIPT = r"""
import gc, json, os, sys, time
from datetime import timedelta
import torch.distributed as dist
from tokenloom.builder.collective import TorchGroup, gather
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                        timeout=timedelta(seconds=60))
group = TorchGroup(timeout_s=60)
group.all_gather_object(rank)  # the first gather's root is rank 0; the second's is rank 1
gc.disable()  # nothing may depend on the collector running
if rank == 1:
    time.sleep(2)  # ranks 0 and 2 are already waiting on rank 1, the root
started = time.perf_counter()
try:
    gather(group, (lambda: None) if rank == 1 else rank, phase="test")  # rank 1 cannot pickle its payload
    error = None
except Exception as exc:
    error = str(exc)
finally:
    group.close()  # what the build's and the tokenization's cleanup do
print(json.dumps({"error": error, "seconds": time.perf_counter() - started}), flush=True)
time.sleep(20)  # alive after giving up: only the close can release a rank blocked on this one
"""


def test_a_rank_that_gives_up_releases_the_ranks_blocked_on_it_at_once():
    """Rank 1, the second gather's root, fails before the collective (its payload does not pickle),
    closes the group and lives on; ranks 0 and 2, blocked on it, must fail at once, not at their
    60 s timeout or rank 1's exit 20 s later. Before, close() destroyed the group but the group
    object kept it (and a failed collective's traceback, through torch's frames, in a cycle only
    the garbage collector breaks), so gloo's connections stayed open."""
    pytest.importorskip("torch.distributed")
    port = free_port()
    env = dict(os.environ)
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, "-c", RELEASE_SCRIPT, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        outcomes = [json.loads(proc.stdout.readline() or "null") for proc in procs]  # before their 20 s sleep
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=60)
    assert all(o is not None and o["error"] for o in outcomes), outcomes
    assert "The build's gather failed in the test phase" in outcomes[1]["error"]
    for rank in (0, 2):
        assert "killed or hung" in outcomes[rank]["error"], outcomes
        assert outcomes[rank]["seconds"] < 12, outcomes  # rank 1 gave up 2 s in; 20+ s: they waited for its exit
