"""A rendered overlay brought up on namespace hosts for a test module
(cluster.py), and torn down after it: what test_k8s_netns.py (dev-cpu) and
test_k8s_autoscaling.py (autoscaling) share.

    @pytest.fixture(scope="module")
    def kube(tmp_path_factory):
        yield from running_cluster(OVERLAY, tmp_path_factory.mktemp("k8s"))
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.netns.harness import NetnsHarness, netns_unavailable

from .cluster import Cluster, clean_stale
from .kube import ROOT, Objects, render

__all__ = ["API_KEY", "running_cluster", "unavailable"]

API_KEY = "kvm15-netns-test-key"


def unavailable(overlay: Path) -> str | None:
    """Why the overlay cannot run here (None: it can)."""
    if reason := netns_unavailable():
        return reason
    for tool in ("kubectl", "dnsmasq", "nft", "unshare", "nsenter"):
        if subprocess.run(["sh", "-c", f"command -v {tool} || test -x /usr/sbin/{tool}"],
                          capture_output=True, check=False).returncode != 0:
            return f"{tool} is not installed (scripts/setup.sh installs it)"
    if not overlay.is_dir():
        return f"{overlay} is missing"
    if not (ROOT / ".models" / "tiny-llama").is_dir():
        return ".models/tiny-llama is missing: run `make setup`"
    return None


def secrets(out: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets scripts/k8s_secrets.sh makes, with the test's API key."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "k8s_secrets.sh"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "KVMESH_API_KEY": API_KEY})
    assert proc.returncode == 0, proc.stderr
    objects = Objects([d for d in yaml.safe_load_all((out / "secrets.yaml").read_text()) if d])
    return {s["metadata"]["name"]: objects.secret(s["metadata"]["name"]) for s in objects.of("Secret")}


def running_cluster(overlay: Path, run_dir: Path) -> Iterator[Cluster]:
    """Every pod of the overlay started (probes passed); yields the cluster,
    then tears it all down and checks nothing is left."""
    if reason := unavailable(overlay):
        pytest.skip(reason)
    clean_stale()
    objects = Objects(render(overlay), secrets(run_dir / "secrets"))
    plan = Cluster.plan(objects)
    cluster: Cluster | None = None
    try:
        with NetnsHarness([*plan.values(), "dns", "client"]) as net:
            cluster = Cluster(net, objects, run_dir, plan)
            cluster.prepare()
            cluster.start()
            net.assert_safe()
            yield cluster
            # The test is over: the gateways' drain (3 s not ready, for a
            # load balancer) buys nothing now (tests/_mesh_stop.py).
            for r in cluster.by_component("gateway"):
                cluster.kill(r)
        assert net.leftovers() == [], f"teardown left {net.leftovers()}"
    finally:
        if cluster is not None:
            cluster.close()
    assert cluster is not None and cluster.leftovers() == [], f"teardown left {cluster.leftovers()}"
