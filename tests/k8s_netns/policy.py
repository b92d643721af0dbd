"""NetworkPolicies (ingress) as nftables rules, one table per pod host, the
way a CNI plugin enforces them: a pod no policy selects accepts everything;
a selected pod accepts only what some rule of a policy selecting it allows
(sources: pods by label in this namespace -> their host addresses,
namespaces by label -> none here but `kvmesh` itself, ipBlocks; ports by
number or by the pod's container port name). Replies to the pod's own
connections and loopback (kubelet's probes come from the node; here from the
pod's own network) are always accepted. Egress rules are not translated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .kube import NAMESPACE, Pod, resolve_port, selects

__all__ = ["nft_ruleset"]

TABLE = "k8s_netpol"
NAMESPACE_LABELS = {"kubernetes.io/metadata.name": NAMESPACE}


def _sources(peer: Mapping[str, Any], pods: list[Pod], addr: Mapping[str, str]) -> list[str]:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        if block.get("except"):
            raise ValueError("ipBlock.except is not translated")
        return [block["cidr"]]
    ns_sel = peer.get("namespaceSelector")
    if ns_sel is not None and not selects(ns_sel, NAMESPACE_LABELS):
        return []  # another namespace (e.g. monitoring): no host of this test is in it
    pod_sel = peer.get("podSelector") or {}
    return [addr[p.name] for p in pods if p.name in addr and selects(pod_sel, p.labels)]


def _rules(pod: Pod, policies: list[dict[str, Any]], pods: list[Pod], addr: Mapping[str, str],
           ports: Mapping[str, int]) -> list[str] | None:
    """nft accept rules for `pod`, or None when no ingress policy selects it."""
    mine = [p for p in policies if "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
            and selects(p["spec"].get("podSelector") or {}, pod.labels)]
    if not mine:
        return None
    rules = []
    for policy in mine:
        for rule in policy["spec"].get("ingress") or ():
            peers = rule.get("from")
            sources: list[str] | None = None
            if peers:
                sources = sorted({s for peer in peers for s in _sources(peer, pods, addr)})
                if not sources:
                    continue
            match_ports = []
            for p in rule.get("ports") or ():
                proto = p.get("protocol", "TCP").lower()
                if "port" not in p:
                    match_ports.append(f"meta l4proto {proto}")
                    continue
                number = resolve_port(p["port"], ports)
                end = p.get("endPort")
                match_ports.append(f"{proto} dport {number}-{end}" if end else f"{proto} dport {number}")
            src = f"ip saddr {{ {', '.join(sources)} }} " if sources is not None else ""
            for m in match_ports or [""]:
                rules.append(f"{src}{m} accept".replace("  ", " ").strip())
    return rules


def nft_ruleset(pod: Pod, policies: list[dict[str, Any]], pods: list[Pod], addr: Mapping[str, str],
                ports: Mapping[str, int], dnat: Mapping[int, int] | None = None) -> str:
    """An `nft -f` script (re)placing this pod host's table: the ingress
    allow-list and, for a Service whose port differs from its target, a DNAT
    (kube-proxy's part)."""
    lines = [f"table inet {TABLE}", f"delete table inet {TABLE}", f"table inet {TABLE} {{"]
    for port, target in (dnat or {}).items():
        lines += ["  chain prerouting { type nat hook prerouting priority dstnat;",
                  f"    tcp dport {port} redirect to :{target}", "  }"]
    rules = _rules(pod, policies, pods, addr, ports)
    lines.append("  chain input { type filter hook input priority filter; policy "
                 + ("accept;" if rules is None else "drop;"))
    lines += ["    ct state established,related accept", "    iif lo accept"]
    lines += [f"    {r}" for r in rules or ()]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"
