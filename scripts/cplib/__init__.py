"""The control-plane benchmark's parts (scripts/bench_control_plane.py): one
or several real scheduler processes over loopback gRPC, driven by synthetic
gateways and synthetic engines in other processes.

    plan.py        the fleets to measure, the offered rates per step, the open-loop arrival times
    workload.py    the shared contexts (prefix hashes) gateways and engines agree on
    procstat.py    a process's CPU seconds and RSS from /proc
    promhist.py    the scheduler's decision histogram from its /metrics text
    figures.py     one step's figures, the capacity, the table
    scheduler_proc.py  the scheduler processes, started the way the launcher starts them
    engines.py     synthetic engines: Connect streams to every replica, load reports, KV events
    gateways.py    synthetic gateways: Admit streams through the gateway's own replica set
    fleet_run.py   one fleet size and scheduler count: processes up, the steps, the samples
    benchmarks_md.py   the section of BENCHMARKS.md
"""
