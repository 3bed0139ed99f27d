"""Joining a process group within a deadline, and what a failed join reads as (one line).

TCPStore's client does not bound everything by its timeout: its connect retries run to about
twice the timeout, and its handshake waits forever on a port that accepts connections and never
answers. `round_store` bounds both; `rendezvous_error` names a taken port, a silent listener, an
unreachable store or a rank that never came, each as a one-line `RendezvousError`.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import threading
import time

import torch.distributed as dist

from .errors import RendezvousError


def _call_within(call, seconds: float):
    """`call()` in a daemon thread, waited for at most `seconds` (else TimeoutError; the thread is
    left behind): TCPStore's client handshake waits forever on a port that never answers."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err
    thread = threading.Thread(target=run, name="maskrcnn_tut-rendezvous", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive() or "error" in box:
        raise box.get("error") or TimeoutError(f"no answer within {seconds:g} s")
    return box["result"]


def _reach(addr: str, port: int, ends: float) -> None:
    """Wait (until `ends`, else ConnectionError) for something to accept TCP connections at the
    store's address: TCPStore's own connect retries run past its timeout."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, ends - time.monotonic()))):
                return
        except OSError as err:
            if time.monotonic() >= ends:
                raise ConnectionError(f"nothing accepted a connection ({err})") from err
            time.sleep(0.2)


def round_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, prefixed by torchrun's restart count (see findings on gloo restarts);
    joining it is bounded by `timeout` (plus 2 s), which TCPStore alone does not do."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master, ends = rank == 0 and not agent_store, time.monotonic() + timeout.total_seconds()
    if not is_master:
        _reach(addr, port, ends)
    store = _call_within(lambda: dist.TCPStore(addr, port, world_size=None if agent_store else world_size,
                                               is_master=is_master, timeout=timeout, wait_for_workers=False),
                         max(0.0, ends - time.monotonic()) + 2)
    return dist.PrefixStore(f"maskrcnn_tut/round{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


#: A taken port, and network faults that are no peer's death even mid-run (DistNetworkError texts).
PORT_TAKEN_SIGNS = ("EADDRINUSE", "ddress already in use")
NETWORK_SIGNS = ("failed to listen", "gai error", "Name or service not known")
UNREACHABLE_SIGNS = ("trying to connect", "Network is unreachable", "No route to host")  # while joining


def rendezvous_error(err: BaseException, rank: int, world_size: int, timeout_s: float | None) -> RendezvousError:
    """One line for a failure to join the group: a taken port, no answer, a rank that never came."""
    text, addr = str(err).strip(), os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = (re.findall(r"port: (\d+)", text) or [os.environ.get("MASTER_PORT", "?")])[0]
    where, first = f"{addr}:{port} (MASTER_ADDR:MASTER_PORT)", (text.splitlines() or [type(err).__name__])[0][:300]
    within = f" within --dist-timeout {timeout_s:g} s" if timeout_s else ""
    pick = "pick a free one with --master-port N (torchrun) or MASTER_PORT=N"
    if any(sign in text for sign in PORT_TAKEN_SIGNS):
        why = f"port {port} is already in use on this machine (another run or program), so rank 0 cannot serve there"
    elif isinstance(err, TimeoutError):
        why = f"{where} accepts connections but did not answer as rank 0's store{within} (another program listening there?)"
    elif isinstance(err, ConnectionError) or any(sign in text for sign in NETWORK_SIGNS + UNREACHABLE_SIGNS):
        return RendezvousError(f"rank {rank}: could not reach rank 0's store at {where}{within}: is rank 0 running, "
                               f"and are address and port right? ({first})")
    elif "wait timeout" in text or "Timed out" in text:
        return RendezvousError(f"rank {rank}: not all {world_size} ranks joined at {where}{within} (did one fail "
                               "to start, or is WORLD_SIZE wrong?)")
    else:
        return RendezvousError(f"rank {rank}: joining the process group at {where} failed: {first}")
    return RendezvousError(f"rank {rank}: {why}; {pick}")
