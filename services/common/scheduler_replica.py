"""Who a scheduler replica is (README "Several schedulers").

Every scheduler process names itself once at start (`new_replica_id`:
host/pid/random, new for every start, so a restarted replica is a new one
and cannot claim the generations its predecessor leased). It sends the name
to each engine as the Connect stream's initial metadata
(`REPLICA_METADATA_KEY`), puts it into every `Placed`
(`Placed.scheduler_replica`; the gateway copies it into the engine request)
and shows it in `SchedulerState.replica`. The engine then takes a fence for
a generation only from the replica that leased it (services/engine/fencing.py).

The same initial metadata says the scheduler reads KV events inside load
reports (`KV_IN_REPORTS_METADATA_KEY`, LoadReport.kv_events): an engine puts
them there only then, so an engine newer than its scheduler still sends
them as KvEvents messages.
"""

from __future__ import annotations

import os
import secrets
import socket

__all__ = ["KV_IN_REPORTS_METADATA_KEY", "REPLICA_METADATA_KEY", "new_replica_id"]

REPLICA_METADATA_KEY = "kvmesh-scheduler-replica"
KV_IN_REPORTS_METADATA_KEY = "kvmesh-kv-in-reports"


def new_replica_id() -> str:
    """This process's replica name: host/pid/6 random hex digits."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"
