"""A rendered overlay's pods on namespace hosts (tests/netns/harness.py):
one host per pod, a `dns` host running dnsmasq as the cluster DNS, a
`client` host outside the cluster.

Per pod, like kubelet: the container's argv and env (kube.py), its volumes
written to a folder of the pod and bind-mounted at their mountPath for that
process only (a private mount namespace: `unshare --mount`, plus its own
UTS (hostname = pod name) and IPC namespaces), /etc/resolv.conf pointing at
the cluster DNS with Kubernetes' search domains and ndots:5, /etc/hosts with
the pod's own name. Probes: httpGet/tcpSocket from the pod's own network
namespace to the pod's address, exec (and preStop) inside the running
container's namespaces (`nsenter`, like `kubectl exec`). NetworkPolicies:
nftables in each pod host (policy.py), applied before anything starts.

Mount points missing on this machine (/etc/kvmesh, /models, ...) are made
as empty folders/files before the first pod starts and removed on close;
a crashed run's are removed by the next run (`clean_stale`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.netns.harness import Host, NetnsHarness

from .host_paths import RUN_BASE, bind_back, needed_by_pods, reach_interpreter, under_mount
from .kube import ROOT, Container, Objects, Pod, Volume, base_env, pods, resolve_port, selects, service_env
from .policy import nft_ruleset

__all__ = ["Cluster", "PodFailed", "RunningPod", "clean_stale"]

DOMAIN = "cluster.local"
NAMESPACE = "kvmesh"
SEARCH = f"{NAMESPACE}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}"
START_TIMEOUT = 90.0
VOL_PREFIX = "k8s-netns-"
MADE = "mount-points-made"


class PodFailed(RuntimeError):
    """A pod's process exited or a probe never passed (its log's tail is in the message)."""


def host_name(pod: Pod, index: int) -> str:
    """A harness host name (<= 10 chars) for a pod: component + index."""
    return f"{pod.component[:6]}{index}"


@dataclass
class RunningPod:
    pod: Pod
    host: Host
    container: Container
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    passed: dict[str, float] = field(default_factory=dict)  # probe kind -> seconds after the start

    @property
    def ip(self) -> str:
        return self.host.address


@dataclass
class Cluster:
    """The pods of `objects` on `net` (which must have a host per pod, plus
    `dns` and `client`). `start()` brings them all up at once."""

    net: NetnsHarness
    objects: Objects
    run_dir: Path
    hosts_of: dict[str, str]  # pod name -> harness host name
    running: dict[str, RunningPod] = field(default_factory=dict)
    made: list[Path] = field(default_factory=list)  # mount points made on this machine
    dns_proc: subprocess.Popen[bytes] | None = None
    links: dict[str, str] = field(default_factory=dict)  # Service-link env of every pod
    gone: set[str] = field(default_factory=set)  # pods deleted: out of DNS until started again
    # Volume contents: under no pod's mount path (host_paths.py), wherever the clone is.
    vol_root: Path = field(default_factory=lambda: RUN_BASE / f"{VOL_PREFIX}{os.getpid()}")

    # ------------------------------------------------------------ layout

    @staticmethod
    def plan(objects: Objects) -> dict[str, str]:
        """pod name -> host name, for every pod the workloads make."""
        counts: dict[str, int] = {}
        out = {}
        for p in pods(objects):
            i = counts[p.component] = counts.get(p.component, -1) + 1
            out[p.name] = host_name(p, i)
        return out

    @property
    def pods(self) -> dict[str, Pod]:
        return {p.name: p for p in pods(self.objects)}

    @property
    def addresses(self) -> dict[str, str]:
        """pod name -> its current address."""
        return {n: self.net.hosts[h].address for n, h in self.hosts_of.items()}

    def by_component(self, component: str) -> list[RunningPod]:
        return [r for r in self.running.values() if r.pod.component == component]

    # ------------------------------------------------------------ DNS

    def _records(self) -> list[tuple[str, str]]:
        """(address, name) of every cluster DNS name: Services (headless: every
        pod it selects; with a cluster IP: its pods' addresses stand in for the
        virtual IP) and StatefulSet pods under their governing Service."""
        addr = self.addresses
        all_pods = [p for p in self.pods.values() if p.name not in self.gone]
        records = []
        for s in self.objects.of("Service"):
            name, sel = s["metadata"]["name"], s["spec"].get("selector") or {}
            for p in all_pods:
                if sel and selects({"matchLabels": sel}, p.labels):
                    records.append((addr[p.name], f"{name}.{NAMESPACE}.svc.{DOMAIN}"))
        for sts in self.objects.of("StatefulSet"):
            svc = sts["spec"]["serviceName"]
            for p in all_pods:
                if p.workload == sts["metadata"]["name"]:
                    records.append((addr[p.name], f"{p.name}.{svc}.{NAMESPACE}.svc.{DOMAIN}"))
        return records

    def write_dns(self) -> None:
        """The DNS server's records (dnsmasq re-reads them on SIGHUP) and each
        host's resolv.conf and hosts."""
        hosts_file = self.run_dir / "cluster-dns.hosts"
        hosts_file.write_text("".join(f"{a} {n}\n" for a, n in self._records()))
        if self.dns_proc is not None and self.dns_proc.poll() is None:
            os.kill(self.dns_proc.pid, 1)  # SIGHUP: re-read
        dns = self.net.hosts["dns"].address
        for host in self.net.hosts.values():
            host.write_etc("resolv.conf", f"nameserver {dns}\nsearch {SEARCH}\noptions ndots:5\n")
        for pod_name, h in self.hosts_of.items():
            host = self.net.hosts[h]
            host.write_etc("hosts", f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n"
                                    f"{host.address}\t{pod_name}\n")

    def start_dns(self) -> None:
        host = self.net.hosts["dns"]
        self.write_dns()
        with (self.run_dir / "dns.log").open("ab") as log:
            self.dns_proc = host.spawn(
                ["dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", "--user=root", "--pid-file=",
                 f"--addn-hosts={self.run_dir / 'cluster-dns.hosts'}", f"--listen-address={host.address}",
                 "--bind-interfaces", f"--local=/{DOMAIN}/", "--local-ttl=0", "--log-queries", "--log-facility=-"], log)
        self.wait_for(lambda: bool(self.resolve(f"kvmesh-scheduler.{NAMESPACE}.svc.{DOMAIN}")), 20,
                      "the cluster DNS to answer")

    # ------------------------------------------------------------ policies

    def apply_policies(self) -> None:
        """Each pod host's nftables table from the rendered NetworkPolicies."""
        policies = self.objects.of("NetworkPolicy")
        all_pods, addr = list(self.pods.values()), self.addresses
        for r in self.running.values():
            script = nft_ruleset(r.pod, policies, all_pods, addr, r.container.ports, self._dnat(r))
            path = self.run_dir / f"{r.pod.name}.nft"
            path.write_text(script)
            out = r.host.run("nft", "-f", str(path), timeout=15)
            if out.returncode != 0:
                raise RuntimeError(f"nft for {r.pod.name}: {out.stderr.strip()}\n{script}")

    def _dnat(self, r: RunningPod) -> dict[int, int]:
        """Service port -> container port where they differ (kube-proxy's job)."""
        out = {}
        for s in self.objects.of("Service"):
            sel = s["spec"].get("selector") or {}
            if sel and selects({"matchLabels": sel}, r.pod.labels):
                for p in s["spec"].get("ports") or ():
                    target = resolve_port(p.get("targetPort", p["port"]), r.container.ports)
                    if target != p["port"]:
                        out[int(p["port"])] = target
                    if "nodePort" in p:  # this pod's host stands in for the node
                        out[int(p["nodePort"])] = target
        return out

    def service_port(self, service: str, name: str | None = None, node: bool = False) -> int:
        """A Service's port (`node`: its nodePort) by port name (None: the first)."""
        ports = self.objects.get("Service", service)["spec"]["ports"]
        port = next(p for p in ports if name is None or p.get("name") == name)
        return int(port["nodePort" if node else "port"])

    # ------------------------------------------------------------ pods

    def prepare(self) -> None:
        """Every pod's container (env, argv, volume files), DNS, policies."""
        stand_ins = {}
        for s in self.objects.of("Service"):
            sel = s["spec"].get("selector") or {}
            match = [p for p in self.pods.values() if sel and selects({"matchLabels": sel}, p.labels)]
            if match:
                stand_ins[s["metadata"]["name"]] = self.addresses[match[0].name]
        self.links = service_env(self.objects, stand_ins)
        for pod in self.pods.values():
            self._prepare_pod(pod)
        self.start_dns()
        self.apply_policies()

    def _prepare_pod(self, pod: Pod) -> RunningPod:
        host = self.net.hosts[self.hosts_of[pod.name]]
        container = pod.container(self.objects, host.address, self.links)
        r = RunningPod(pod, host, container, self.run_dir / f"{pod.name}.log")
        self.running[pod.name] = r
        return r

    def _mount_script(self, r: RunningPod) -> str:
        """sh: hostname, each volume mounted at its path (parents first; read-only
        where the mount says so), the root filesystem read-only if the container
        asks, then the command as the container's user."""
        c = r.container
        lines = ["set -e", f"hostname {shlex.quote(r.pod.name)}"]
        folder = self.vol_root / r.pod.name
        # The code and venv under a mount path (a clone under /tmp) stay reachable.
        keep, bind_back_after = bind_back(needed_by_pods(ROOT), [v.path for v in c.volumes], folder, c.read_only_root)
        lines += keep
        # A non-root pod runs the venv's own interpreter (pyenv's, under a 0700
        # home), not the system's libpython and standard library it would fall back to.
        if c.user not in (None, 0):
            lines += reach_interpreter(Path(sys.base_prefix), folder, needed_by_pods(ROOT))
        for i, vol in enumerate(sorted(c.volumes, key=lambda v: v.path.count("/"))):
            src = self._volume_source(vol, folder / f"vol{i}", c.fs_group)
            dst = shlex.quote(vol.path)
            self._mount_point(Path(vol.path), is_file=bool(vol.sub_path))
            lines.append(f"mount -t tmpfs -o mode=1777 tmpfs {dst}" if vol.memory
                         else f"mount --bind {shlex.quote(str(src))} {dst}")
            lines += bind_back_after.get(vol.path, [])
            if vol.read_only:
                lines.append(f"mount -o remount,bind,ro {dst}")
        if c.read_only_root:
            lines.append("mount -o remount,bind,ro /")
        lines.append(f'exec {self._as_user(c)} "$@"')
        return "\n".join(lines)

    @staticmethod
    def _as_user(c: Container) -> str:
        """setpriv to the container's runAsUser/runAsGroup (+ fsGroup), or nothing (root)."""
        if c.user is None:
            return ""
        group = c.group if c.group is not None else c.user
        extra = f" --groups {c.fs_group}" if c.fs_group is not None else " --clear-groups"
        return f"setpriv --reuid {c.user} --regid {group}{extra} --"

    def _volume_source(self, vol: Volume, folder: Path, fs_group: int | None) -> Path:
        if vol.claim:
            return self.claim_dir(vol.claim, fs_group)
        if vol.host_dir is not None:
            return vol.host_dir / vol.sub_path if vol.sub_path else vol.host_dir
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777 if vol.files is None else 0o755)  # an emptyDir is world-writable
        for rel, data in (vol.files or {}).items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(vol.mode)
            if fs_group is not None:  # kubelet: volume files owned by the fsGroup
                os.chown(path, 0, fs_group)
        if vol.sub_path:
            if not (folder / vol.sub_path).exists():
                raise RuntimeError(f"subPath {vol.sub_path} not in the volume for {vol.path}")
            return folder / vol.sub_path
        return folder

    def claim_dir(self, claim: str, fs_group: int | None = None) -> Path:
        """The folder standing in for PersistentVolumeClaim `claim` (a
        StatefulSet's volumeClaimTemplates): one per claim, not per pod start,
        so what a pod wrote is there when it restarts or is rescheduled (the
        claim follows the pod, as a network volume would). Owned by the
        fsGroup, group-writable and setgid, as kubelet prepares a volume."""
        path = self.vol_root / "claims" / claim
        if not path.is_dir():
            path.mkdir(parents=True)
            if fs_group is not None:
                os.chown(path, 0, fs_group)
            path.chmod(0o2775 if fs_group is not None else 0o777)
        return path

    def _mount_point(self, path: Path, is_file: bool) -> None:
        """Make a missing mount point on this machine (removed on close)."""
        if path.exists():
            return
        missing = [p for p in [path, *path.parents] if not p.exists()]
        self.vol_root.mkdir(parents=True, exist_ok=True)
        for p in reversed(missing):
            with (self.vol_root / MADE).open("a") as record:  # for clean_stale, should this run crash
                record.write(f"{p}\n")
            if p == path and is_file:
                p.touch()
            else:
                p.mkdir()
            self.made.append(p)

    def spawn(self, r: RunningPod) -> None:
        """Start the pod's container on its host."""
        if under_mount(self.vol_root, [v.path for v in r.container.volumes]) is not None:
            raise RuntimeError(f"{self.vol_root} is under a mount path of {r.pod.name}")
        script = self._mount_script(r)
        argv = ["unshare", "--mount", "--uts", "--ipc", "--propagation", "private", "sh", "-c", script,
                r.pod.name, *r.container.argv]
        env = {**base_env(), **r.container.env}
        with r.log.open("ab") as log:
            log.write(f"--- {r.pod.name} on {r.host.name} ({r.ip}): {shlex.join(r.container.argv)}\n".encode())
            log.flush()
            r.proc = r.host.spawn(argv, log, env=env, cwd=ROOT)
        r.started_at = time.monotonic()

    def start(self) -> None:
        """Every pod at once (as a cluster would), then each one's probes in
        kubelet's order: startup until it passes, then readiness and liveness."""
        for r in self.running.values():
            self.spawn(r)
        for r in self.running.values():
            self.wait_started(r)

    def wait_started(self, r: RunningPod, timeout: float = START_TIMEOUT) -> float:
        """Seconds until the pod's startup then readiness probes pass (each
        one's pass time, from the process start, in `r.passed`)."""
        t0 = time.monotonic()
        for kind in ("startupProbe", "readinessProbe"):
            probe = r.container.probes.get(kind)
            if probe is not None:
                self.wait_for(lambda p=probe: self.probe(r, p), max(1.0, timeout - (time.monotonic() - t0)),  # type: ignore[misc]  # mypy cannot type a lambda with a default argument
                              f"{r.pod.name}'s {kind}", check=r)
                r.passed[kind] = time.monotonic() - r.started_at
        return time.monotonic() - t0

    # ------------------------------------------------------------ probes and exec

    def probe(self, r: RunningPod, probe: Mapping[str, Any]) -> bool:
        """One probe as kubelet runs it (timeouts at least 5 s: a loaded CI)."""
        timeout = max(5.0, float(probe.get("timeoutSeconds", 1)))
        if "httpGet" in probe:
            return 200 <= self.http_get(r, probe["httpGet"], timeout)[0] < 400
        if "tcpSocket" in probe:
            port = resolve_port(probe["tcpSocket"]["port"], r.container.ports)
            return r.host.call(lambda: connect(r.ip, port, timeout), timeout=timeout + 5) == "connected"
        if "exec" in probe:
            return self.exec(r, probe["exec"]["command"], timeout).returncode == 0
        raise ValueError(f"unsupported probe {sorted(probe)}")

    def http_get(self, r: RunningPod, get: Mapping[str, Any], timeout: float = 5.0) -> tuple[int, str]:
        port = resolve_port(get["port"], r.container.ports)
        url = f"{get.get('scheme', 'HTTP').lower()}://{get.get('host', r.ip)}:{port}{get.get('path', '/')}"
        return r.host.call(lambda: http_get(url, timeout), timeout=timeout + 5)

    def exec(self, r: RunningPod, command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """`kubectl exec`: command inside the running container's namespaces
        (network, mounts, hostname, IPC), with its environment."""
        from .kube import kvmesh_argv

        if r.proc is None or r.proc.poll() is not None:
            raise PodFailed(f"{r.pod.name} is not running")
        argv = ["nsenter", "-t", str(r.proc.pid), "-n", "-m", "-u", "-i", f"--wd={ROOT}", "--",
                *shlex.split(self._as_user(r.container)), *kvmesh_argv(command)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT,
                              env={**base_env(), **r.container.env})

    # ------------------------------------------------------------ reschedule

    def reschedule(self, pod_name: str, new_host: str, lost: bool = False) -> RunningPod:
        """The pod deleted (`kubectl delete pod --force`): its DNS names removed
        (the endpoints controller acts on the deletion), its process killed
        (SIGKILL), its address gone (the host's port down: silence, as for an
        IP no node has any more); then the same pod started on a new host with
        a new address, its DNS names back (pointing there) and every host's
        policies following it, as the endpoints controller and the CNI would.
        `lost`: the pod's node dropped off the network instead (its process
        runs on, unreachable, as on a partitioned node whose pod an operator
        force-deleted so that the StatefulSet makes it again elsewhere)."""
        old = self.running[pod_name]
        fqdn = f"{pod_name}.{self.pods[pod_name].spec.get('subdomain') or self._service_of(old.pod)}"
        self.gone.add(pod_name)
        self.write_dns()
        self.wait_for(lambda: self.resolve(fqdn) == [], 10, f"{fqdn} out of DNS")
        if not lost:
            self.kill(old)
        self.net.cut(old.host.name)
        self.net.add_host(new_host)
        self.hosts_of[pod_name] = new_host
        r = self._prepare_pod(old.pod)
        self.gone.discard(pod_name)
        self.write_dns()
        self.wait_for(lambda: self.resolve(fqdn) == [r.ip], 10, f"{fqdn} at {r.ip} in DNS")
        self.apply_policies()
        self.spawn(r)
        return r

    def restart(self, pod_name: str, sig: int = 9) -> RunningPod:
        """The pod's container killed (`sig`, SIGKILL by default: a crash, an
        OOM kill) and started again by kubelet (restartPolicy Always): the same
        pod, host, address and volumes -- its claims' folders keep what it
        wrote. Returns at once; `wait_started` waits for its probes."""
        old = self.running[pod_name]
        self.kill(old, sig)
        r = self._prepare_pod(old.pod)
        self.spawn(r)
        return r

    def create_pod(self, pod: Pod, host: str) -> RunningPod:
        """A pod the workload's controller makes (a StatefulSet scaled out):
        a new host on the network, its DNS names, every host's policies
        (the new address among the allowed sources), its process started.
        Returns at once; `wait_started` waits for its probes."""
        self.net.add_host(host)
        self.hosts_of[pod.name] = host
        r = self._prepare_pod(pod)
        self.write_dns()
        self.apply_policies()
        self.spawn(r)
        return r

    def delete_pod(self, pod_name: str) -> dict[str, float]:
        """`kubectl delete pod` as kubelet carries it out: the pod leaves DNS
        (the endpoints controller), its preStop hook runs, then SIGTERM,
        SIGKILL at the end of terminationGracePeriodSeconds; its address
        goes. Seconds of each step (`prestop`, `exit`) and `killed` (1 if
        the grace period ran out)."""
        r = self.running[pod_name]
        grace, t0 = r.pod.grace_seconds, time.monotonic()
        self.gone.add(pod_name)
        self.write_dns()
        if r.container.pre_stop:
            with contextlib.suppress(subprocess.TimeoutExpired, PodFailed):
                self.exec(r, r.container.pre_stop, timeout=grace)
        out = {"prestop": time.monotonic() - t0, "killed": 0.0}
        if r.proc is not None and r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, 15)
            try:
                r.proc.wait(timeout=max(1.0, grace - out["prestop"]))
            except subprocess.TimeoutExpired:
                out["killed"] = 1.0
                self.kill(r)
        out["exit"] = time.monotonic() - t0 - out["prestop"]
        self.net.cut(r.host.name)
        del self.running[pod_name], self.hosts_of[pod_name]
        self.gone.discard(pod_name)
        return out

    def _service_of(self, pod: Pod) -> str:
        """The governing Service of a StatefulSet pod."""
        return str(self.objects.get("StatefulSet", pod.workload)["spec"]["serviceName"])

    def resolve(self, name: str, host: str = "client") -> list[str]:
        """IPv4 addresses `name` resolves to on `host` (its resolv.conf: the cluster DNS)."""
        out = self.net.hosts[host].run("getent", "ahostsv4", name, timeout=10)
        return sorted({line.split()[0] for line in out.stdout.splitlines() if line.strip()})

    @staticmethod
    def kill(r: RunningPod, sig: int = 9) -> None:
        if r.proc is not None and r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, sig)
            r.proc.wait(timeout=15)

    def log_tail(self, r: RunningPod, lines: int = 30) -> str:
        return "\n".join(r.log.read_text(errors="replace").splitlines()[-lines:]) if r.log.exists() else ""

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str, check: RunningPod | None = None,
                 poll: float = 0.2) -> float:
        """Poll until predicate() (errors count as false); seconds waited.
        With `check`, fail at once if that pod's process exits."""
        t0 = time.monotonic()
        while True:
            if check is not None and check.proc is not None and check.proc.poll() is not None:
                raise PodFailed(f"{check.pod.name} exited with {check.proc.returncode} while waiting for {what}:\n"
                                f"{self.log_tail(check)}")
            with contextlib.suppress(OSError, TimeoutError):
                if predicate():
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                tail = f":\n{self.log_tail(check)}" if check is not None else ""
                raise PodFailed(f"timed out after {timeout:.0f} s waiting for {what}{tail}")
            time.sleep(poll)

    def close(self) -> None:
        """After the harness's teardown (processes, namespaces, /etc/netns
        files, nft tables): remove the mount points made on this machine and
        the volume folders."""
        _remove_made(list(self.made))
        shutil.rmtree(self.vol_root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this run is still on this machine's filesystem (after close: nothing)."""
        return [str(p) for p in [*self.made, self.vol_root] if p.exists() or p.is_symlink()]


def _remove_made(paths: list[Path]) -> None:
    """Remove mount points this module made (empty folders, empty files), deepest first."""
    for p in reversed(paths):
        with contextlib.suppress(OSError):
            if p.is_dir():
                p.rmdir()
            elif p.is_file() and p.stat().st_size == 0:
                p.unlink()


def clean_stale() -> list[str]:
    """Mount points and volume folders of runs whose process is gone (crashed
    or killed before its teardown): removed; what was."""
    removed = []
    for folder in RUN_BASE.glob(f"{VOL_PREFIX}*"):
        pid = folder.name.removeprefix(VOL_PREFIX)
        if pid.isdigit() and not _alive(int(pid)):
            made = folder / MADE
            _remove_made([Path(line) for line in made.read_text().splitlines()] if made.exists() else [])
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def http_get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def connect(address: str, port: int, timeout: float) -> str:
    """'connected', 'refused' or 'timeout' (a dropped SYN)."""
    with socket.socket() as s:
        s.settimeout(timeout)
        try:
            s.connect((address, port))
        except ConnectionRefusedError:
            return "refused"
        except (TimeoutError, OSError) as exc:
            return "timeout" if isinstance(exc, TimeoutError) else f"error {exc}"
        return "connected"
