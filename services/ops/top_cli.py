"""`kvmesh top`: one look at a running fleet, refreshed every second (rich
Live); `--once` prints one frame and exits (scripts, the README's capture).
What is shown and where it comes from: top_data.py."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.live import Live

from services.common.config import MeshConfig

from .connect import scheduler_address, scheduler_channel
from .top_data import Gatherer, targets
from .top_render import render

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, run_with_config: Callable[[argparse.Namespace], None]) -> None:
    p = sub.add_parser("top", help="a live terminal view of a running mesh (engines, queues, gateways)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--scheduler", metavar="HOST:PORT", help="the scheduler (default: from the config)")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway replicas whose metrics ports (gateway.metrics_port + r) to read (default 1)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true",
                   help="print one frame and exit (rates need two looks: taken --interval apart)")
    p.set_defaults(func=run_with_config)


def run(config: MeshConfig, ns: argparse.Namespace) -> int:
    address = scheduler_address(config, ns.scheduler)
    engines, gateways, scheduler_metrics = targets(config, max(0, ns.gateways))
    interval = max(0.2, ns.interval)
    with scheduler_channel(config, address) as channel:
        gatherer = Gatherer(channel, address, engines, gateways, scheduler_metrics)
        try:
            console = Console()
            if ns.once:
                gatherer.frame()              # the first look: counters for the rates
                time.sleep(interval)
                console.print(render(gatherer.frame(), console.width))
                return 0
            with Live(render(gatherer.frame(), console.width), console=console, auto_refresh=False,
                      screen=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render(gatherer.frame(), console.width), refresh=True)
        except KeyboardInterrupt:
            return 0
        finally:
            gatherer.close()
