"""Cross-checks of rendered manifests against the code they run.

Each `check_*` takes one overlay's rendered objects and returns the problems
it found (empty = consistent): a `kvmesh` command line the real argparse
parser refuses, an env var nothing reads, a kvmesh.yaml the real loader
refuses, a port the service does not listen on (or a listening port no
containerPort names), a probe path the services do not serve, a preStop
that does not drain, a grace period shorter than the drain bound, Envoy's
config pointing at names or files the manifests do not provide.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.common.config import ConfigError, MeshConfig, load_config
from services.edge.render import GRPC_CLUSTER, HTTP_CLUSTER

from .manifests import ROOT, Obj, ident

# The contract (BRIEF15): kubelet probes, plain HTTP on the metrics port.
PROBE_PATH = {"startupProbe": "/health/started", "readinessProbe": "/health/ready",
              "livenessProbe": "/health/live"}
# Prometheus' own (the autoscaling overlay's), on its web port.
PROMETHEUS_PROBE_PATH = {"readinessProbe": "/-/ready", "livenessProbe": "/-/healthy"}
CONFIG_PATH = "/etc/kvmesh/kvmesh.yaml"
COMPONENTS = ("scheduler", "gateway", "engine", "batch", "envoy")
# Components that hold no mesh identity: the batch service serves plain HTTP
# to Envoy alone (NetworkPolicy) and sends its lines through Envoy's
# listener, like any client (BATCH_INTERFACE: batch.port has no mesh TLS);
# Redis (the official image) serves gateways and the scheduler alone
# (wiring_redis.py); the autoscaling overlay's Prometheus scrapes the
# schedulers' plain-HTTP metrics port and answers KEDA (wiring_autoscaling.py).
NO_MESH_TLS = ("batch", "redis", "prometheus")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
# Seconds between a drain's bound and kubelet's SIGKILL, at least.
DRAIN_MARGIN = 5.0
# Values the downward API gives in a real pod, to expand $(VAR) references.
_FIELD_SAMPLES = {"metadata.name": "kvmesh-engine-0", "metadata.namespace": "kvmesh"}


@dataclass
class Pod:
    """One workload's pod template and its main container."""

    workload: Obj
    component: str
    spec: dict[str, Any]
    container: dict[str, Any]

    @property
    def name(self) -> str:
        return ident(self.workload)

    def volume(self, mount_path: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(volumeMount, volume) mounted at `mount_path`."""
        for mount in self.container.get("volumeMounts", []):
            if mount["mountPath"] == mount_path:
                vol = next(v for v in self.spec.get("volumes", []) if v["name"] == mount["name"])
                return mount, vol
        return None

    def env(self) -> dict[str, str]:
        """Env values, downward-API fields replaced by sample values."""
        out = {}
        for var in self.container.get("env", []):
            if "value" in var:
                out[var["name"]] = var["value"]
            elif "fieldRef" in var.get("valueFrom", {}):
                out[var["name"]] = _FIELD_SAMPLES.get(var["valueFrom"]["fieldRef"]["fieldPath"], "x")
            else:
                out[var["name"]] = "x"
        return out

    def argv(self) -> list[str]:
        return [*self.container.get("command", []), *self.container.get("args", [])]

    def is_kvmesh(self) -> bool:
        return self.container.get("image", "").split(":")[0].split("/")[-1] == "kvmesh"


def pods(objects: list[Obj]) -> list[Pod]:
    out = []
    for obj in objects:
        if obj["kind"] not in WORKLOAD_KINDS:
            continue
        template = obj["spec"]["template"]
        component = template["metadata"]["labels"].get("app.kubernetes.io/component", "")
        spec = template["spec"]
        out.append(Pod(obj, component, spec, spec["containers"][0]))
    return out


def pod_labels(pod: Pod) -> dict[str, str]:
    """The labels of the pod's template (what selectors and policies match)."""
    return dict(pod.workload["spec"]["template"]["metadata"]["labels"])


def pod_of(objects: list[Obj], component: str) -> Pod:
    return next(p for p in pods(objects) if p.component == component)


def find(objects: list[Obj], kind: str, name: str) -> Obj | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def namespace(objects: list[Obj]) -> str:
    return str(next(o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]))


# ------------------------------------------------------------------ commands


def expand(value: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """Kubernetes' $(VAR) expansion; also the names it could not expand."""
    missing = []

    def sub(match: re.Match[str]) -> str:
        if match.group(1) in env:
            return env[match.group(1)]
        missing.append(match.group(1))
        return match.group(0)

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value), missing


def parse_kvmesh(argv: list[str]) -> tuple[Any, str]:
    """The real `kvmesh` parser on argv (without the program name):
    (namespace, "") or (None, the parser's complaint)."""
    import contextlib
    import io

    from services.cli import _parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return _parser().parse_args(argv), ""
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1] if err.getvalue() else "refused"


def pod_args(pod: Pod) -> tuple[Any, list[str]]:
    """The pod's kvmesh command line, parsed; problems found on the way."""
    env = pod.env()
    argv, problems = [], []
    for arg in pod.argv():
        value, missing = expand(arg, env)
        problems += [f"{pod.name}: $({m}) in the command line is no env var of the container" for m in missing]
        argv.append(value)
    # The image's entrypoint is `kvmesh`: args alone, or a command naming it.
    if pod.container.get("command"):
        if argv[0] != "kvmesh":
            return None, [*problems, f"{pod.name}: command {argv[0]!r} is not kvmesh"]
        argv = argv[1:]
    ns, error = parse_kvmesh(argv)
    if ns is None:
        return None, [*problems, f"{pod.name}: `kvmesh {' '.join(argv)}`: {error}"]
    if ns.command != pod.component:
        problems.append(f"{pod.name}: runs `kvmesh {ns.command}`, not `kvmesh {pod.component}`")
    return ns, problems


def check_commands(objects: list[Obj]) -> list[str]:
    problems = []
    for pod in pods(objects):
        if pod.is_kvmesh():
            problems += pod_args(pod)[1]
        exec_ = pod.container.get("lifecycle", {}).get("preStop", {}).get("exec")
        if exec_:
            cmd = exec_["command"]
            if cmd[0] != "kvmesh":
                problems.append(f"{pod.name}: preStop runs {cmd[0]!r}, not kvmesh")
                continue
            ns, error = parse_kvmesh(cmd[1:])
            if ns is None:
                problems.append(f"{pod.name}: preStop `{' '.join(cmd)}`: {error}")
            elif ns.command != "drain":
                problems.append(f"{pod.name}: preStop runs `kvmesh {ns.command}`, not `kvmesh drain`")
    return problems


# ------------------------------------------------------------------ env


def env_read_by_code() -> set[str]:
    """Env var names services/ reads (os.environ[...] / .get / getenv)."""
    pattern = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']""")
    names: set[str] = set()
    for path in (ROOT / "services").rglob("*.py"):
        names.update(pattern.findall(path.read_text()))
    return names


def check_env(objects: list[Obj]) -> list[str]:
    """Every env var a kvmesh container sets is read by the code, or used
    by the manifest itself through $(NAME) in the command line."""
    read = env_read_by_code()
    problems = []
    for pod in pods(objects):
        if not pod.is_kvmesh():
            continue
        text = " ".join([*pod.argv(), *(v.get("value", "") for v in pod.container.get("env", []))])
        for var in pod.container.get("env", []):
            name = var["name"]
            if name not in read and f"$({name})" not in text:
                problems.append(f"{pod.name}: env {name} is read by no code (services/) and used by no $({name})")
    return problems


# ------------------------------------------------------------------ config


def mesh_config(objects: list[Obj], pod: Pod) -> tuple[MeshConfig | None, list[str]]:
    """The kvmesh.yaml the pod's KVMESH_CONFIG names, loaded by the real loader."""
    path = pod.env().get("KVMESH_CONFIG")
    if path is None:
        return None, [f"{pod.name}: no KVMESH_CONFIG (the default config/kvmesh.yaml is not for pods)"]
    found = pod.volume(path)
    if found is None or "configMap" not in found[1]:
        return None, [f"{pod.name}: KVMESH_CONFIG={path} is no ConfigMap file mounted in the container"]
    mount, vol = found
    cm = find(objects, "ConfigMap", vol["configMap"]["name"])
    key = mount.get("subPath", "")
    if cm is None or key not in cm.get("data", {}):
        return None, [f"{pod.name}: ConfigMap {vol['configMap']['name']} has no key {key!r}"]
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "kvmesh.yaml"
        file.write_text(cm["data"][key])
        try:
            return load_config(file), []
        except ConfigError as exc:
            return None, [f"{pod.name}: {cm['metadata']['name']}/{key} does not load: {exc}"]


def check_config(objects: list[Obj]) -> list[str]:
    problems = []
    for pod in pods(objects):
        if not pod.is_kvmesh():
            continue
        cfg, found = mesh_config(objects, pod)
        problems += found
        if cfg is None:
            continue
        problems += _check_tls_files(pod, cfg)
        problems += _check_bind(pod, cfg)
        problems += _check_api_keys_file(pod, cfg)
    return problems


def _secret_files(pod: Pod, folder: str) -> tuple[str, set[str]] | None:
    """(Secret name, file names) of the Secret mounted at `folder`."""
    found = pod.volume(folder)
    if found is None or "secret" not in found[1]:
        return None
    secret = found[1]["secret"]
    items = secret.get("items")
    return secret["secretName"], ({i["path"] for i in items} if items else {"*"})


def _check_tls_files(pod: Pod, cfg: MeshConfig) -> list[str]:
    if pod.component in NO_MESH_TLS:
        return []
    if not cfg.mesh_tls.enabled:
        return [f"{pod.name}: mesh_tls is off: every service would accept plaintext from the network"]
    files = _secret_files(pod, cfg.mesh_tls.cert_dir)
    if files is None:
        return [f"{pod.name}: mesh_tls.cert_dir {cfg.mesh_tls.cert_dir} is no Secret mounted in the container"]
    need = {"ca.pem", f"{pod.component}.pem", f"{pod.component}-key.pem"}
    missing = need - files[1] if "*" not in files[1] else set()
    return [f"{pod.name}: {files[0]} at {cfg.mesh_tls.cert_dir} lacks {sorted(missing)}"] if missing else []


def _check_api_keys_file(pod: Pod, cfg: MeshConfig) -> list[str]:
    path = getattr(cfg.gateway, "api_keys_file", "")
    if pod.component not in ("gateway", "batch") or not path:
        return []
    files = _secret_files(pod, str(Path(path).parent))
    if files is None or ("*" not in files[1] and Path(path).name not in files[1]):
        return [f"{pod.name}: gateway.api_keys_file {path} is in no Secret mounted in the container"]
    return []


def _check_bind(pod: Pod, cfg: MeshConfig) -> list[str]:
    """Services bind every address. (Which schedulers gateways and engines
    dial: wiring_scheduler.py.)"""
    problems = []
    hosts = {"scheduler": cfg.scheduler.host, "gateway": cfg.gateway.host,
             "engine": cfg.engines.template.host, "batch": cfg.batch.host}
    if pod.component in hosts and hosts[pod.component] not in ("0.0.0.0", "::"):
        problems.append(f"{pod.name}: binds {hosts[pod.component]}, unreachable from other pods "
                        "(use 0.0.0.0 or ::)")
    return problems


def service_target(objects: list[Obj], address: str) -> tuple[str, int] | None:
    """`name[.ns[.svc.cluster.local]]:port` -> (component, container port)
    the Service sends it to; None if no Service answers there."""
    host, _, port = address.rpartition(":")
    name = host.split(".")[0]
    svc = find(objects, "Service", name)
    if svc is None or not port.isdigit():
        return None
    if host not in (name, f"{name}.{namespace(objects)}", f"{name}.{namespace(objects)}.svc",
                    f"{name}.{namespace(objects)}.svc.cluster.local"):
        return None
    for sp in svc["spec"]["ports"]:
        if sp["port"] == int(port):
            pod = selected_pod(objects, svc)
            if pod is None:
                return None
            return pod.component, resolve_port(pod, sp.get("targetPort", sp["port"]))
    return None


# ------------------------------------------------------------------ ports


def listening_ports(objects: list[Obj], pod: Pod) -> dict[str, int]:
    """What the pod's process listens on, by role (grpc/http/metrics), as
    its config and command line make it (not as the manifest says)."""
    if pod.component == "redis":
        return redis_ports(pod)
    if pod.component == "prometheus":
        return prometheus_ports(pod)
    if pod.component == "envoy":
        boot = envoy_bootstrap(objects, pod)
        if boot is None:
            return {}
        ports = {"public": "http", "stats": "metrics"}
        return {ports[listener["name"]]: int(listener["address"]["socket_address"]["port_value"])
                for listener in boot["static_resources"]["listeners"] if listener["name"] in ports}
    cfg, _ = mesh_config(objects, pod)
    ns, _ = pod_args(pod)
    if cfg is None or ns is None:
        return {}
    if pod.component == "scheduler":
        return {"grpc": cfg.scheduler.port, "metrics": cfg.scheduler.metrics_port}
    if pod.component == "gateway":
        gw = cfg.gateway
        return {"http": ns.http_port or gw.http_port, "grpc": ns.grpc_port or gw.grpc_port,
                "metrics": ns.metrics_port or gw.metrics_port}
    if pod.component == "batch":
        return {"http": ns.port or cfg.batch.port, "metrics": ns.metrics_port or cfg.batch.metrics_port}
    engine = cfg.engine_config(ns.index)
    engine_ports = {"grpc": engine.port, "metrics": engine.metrics_port, "http": engine.http_port}
    return {k: v for k, v in engine_ports.items() if v}


def redis_ports(pod: Pod) -> dict[str, int]:
    """What `redis-server --port N` listens on (6379 without the flag)."""
    argv = pod.argv()
    if not argv or argv[0] != "redis-server":
        return {}
    port = argv[argv.index("--port") + 1] if "--port" in argv[:-1] else "6379"
    return {"redis": int(port)} if port.isdigit() else {}


def prometheus_ports(pod: Pod) -> dict[str, int]:
    """What `prometheus --web.listen-address=[HOST]:N` listens on (9090 without the flag)."""
    argv = pod.argv()
    if not argv or argv[0].rsplit("/", 1)[-1] != "prometheus":
        return {}
    flag = next((a.split("=", 1)[1] for a in argv if a.startswith("--web.listen-address=")), ":9090")
    port = flag.rpartition(":")[2]
    return {"http": int(port)} if port.isdigit() else {}


def envoy_admin_port(objects: list[Obj], pod: Pod) -> int | None:
    boot = envoy_bootstrap(objects, pod)
    return None if boot is None else int(boot["admin"]["address"]["socket_address"]["port_value"])


def resolve_port(pod: Pod, port: int | str) -> int:
    """A named port -> its containerPort number (numbers pass through; -1 = unknown name)."""
    if isinstance(port, int):
        return port
    return next((p["containerPort"] for p in pod.container.get("ports", []) if p.get("name") == port), -1)


def selected_pod(objects: list[Obj], svc: Obj) -> Pod | None:
    selector = svc["spec"].get("selector", {})
    for pod in pods(objects):
        labels = pod.workload["spec"]["template"]["metadata"]["labels"]
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            return pod
    return None


def check_ports(objects: list[Obj]) -> list[str]:
    problems = []
    for pod in pods(objects):
        listening = listening_ports(objects, pod)
        declared = {p["containerPort"] for p in pod.container.get("ports", [])}
        for role, port in listening.items():
            if port not in declared:
                problems.append(f"{pod.name}: listens on {port} ({role}) but no containerPort says so")
        for port in declared - set(listening.values()):
            problems.append(f"{pod.name}: containerPort {port} is no port the process listens on")
        if pod.component == "envoy" and envoy_admin_port(objects, pod) in declared:
            problems.append(f"{pod.name}: Envoy's admin port is a containerPort; it must stay private")
        problems += _check_probes(pod, listening)
    for svc in (o for o in objects if o["kind"] == "Service"):
        problems += _check_service(objects, svc)
    return problems


def _check_probes(pod: Pod, listening: dict[str, int]) -> list[str]:
    if pod.component == "prometheus":
        return _check_prometheus_probes(pod, listening)
    problems = []
    for kind, path in PROBE_PATH.items():
        probe = pod.container.get(kind)
        if probe is None:
            if pod.component in ("engine",) or (pod.is_kvmesh() and kind != "startupProbe"):
                problems.append(f"{pod.name}: no {kind}")
            continue
        if "httpGet" in probe:
            get = probe["httpGet"]
            if get.get("path") != path:
                problems.append(f"{pod.name}: {kind} path {get.get('path')} is not {path}")
            if resolve_port(pod, get["port"]) != listening.get("metrics"):
                problems.append(f"{pod.name}: {kind} port {get['port']} is not the metrics port "
                                f"{listening.get('metrics')}")
            if get.get("scheme", "HTTP") != "HTTP":
                problems.append(f"{pod.name}: {kind} is not plain HTTP (the metrics port is)")
        elif "tcpSocket" in probe:
            if resolve_port(pod, probe["tcpSocket"]["port"]) not in listening.values():
                problems.append(f"{pod.name}: {kind} checks a port nothing listens on")
        elif "exec" in probe and "redis" in listening:
            # Redis answers PING on its own port (it has no HTTP port to ask).
            if probe["exec"]["command"] != ["redis-cli", "-p", str(listening["redis"]), "ping"]:
                problems.append(f"{pod.name}: {kind} {probe['exec']['command']} is not "
                                f"`redis-cli -p {listening['redis']} ping`")
        else:
            problems.append(f"{pod.name}: {kind} is neither httpGet nor tcpSocket")
    return problems


def _check_prometheus_probes(pod: Pod, listening: dict[str, int]) -> list[str]:
    """Prometheus' own health endpoints on its one HTTP port."""
    problems = []
    for kind, path in PROMETHEUS_PROBE_PATH.items():
        get = pod.container.get(kind, {}).get("httpGet")
        if get is None:
            problems.append(f"{pod.name}: no httpGet {kind}")
        elif get.get("path") != path or resolve_port(pod, get["port"]) != listening.get("http"):
            problems.append(f"{pod.name}: {kind} asks {get.get('path')} on {get['port']}, not {path} on "
                            f"{listening.get('http')}")
    return problems


def _check_service(objects: list[Obj], svc: Obj) -> list[str]:
    name = ident(svc)
    pod = selected_pod(objects, svc)
    if pod is None:
        return [f"{name}: its selector matches no workload"]
    listening = listening_ports(objects, pod)
    problems = []
    for sp in svc["spec"]["ports"]:
        target = resolve_port(pod, sp.get("targetPort", sp["port"]))
        if target not in listening.values():
            problems.append(f"{name}: port {sp['port']} -> {sp.get('targetPort')} reaches nothing {pod.name} "
                            "listens on")
        elif sp["port"] != target:
            problems.append(f"{name}: port {sp['port']} differs from its target {target} (the contract's ports)")
    if pod.component == "envoy":
        admin = envoy_admin_port(objects, pod)
        if any(sp["port"] == admin or sp.get("targetPort") == admin for sp in svc["spec"]["ports"]):
            problems.append(f"{name}: exposes Envoy's admin port")
    if pod.component in ("gateway", "engine", "batch") and svc["spec"].get("clusterIP") != "None":
        problems.append(f"{name}: not headless (clusterIP: None)")
    return problems


# ------------------------------------------------------------------ drain


def drain_bound(cfg: MeshConfig, component: str) -> float:
    """Seconds a drain may take: the gateway's drain bound (drain_seconds, by
    default the generation bound), engine stop_grace_seconds, batch.drain_seconds."""
    return {"gateway": cfg.gateway.drain_bound_seconds,
            "engine": cfg.engines.template.stop_grace_seconds,
            "batch": cfg.batch.drain_seconds}.get(component, 0.0)


def check_drain(objects: list[Obj]) -> list[str]:
    problems = _check_envoy_drain(objects)
    for pod in pods(objects):
        if pod.component not in ("gateway", "engine", "batch"):
            continue
        exec_ = pod.container.get("lifecycle", {}).get("preStop", {}).get("exec")
        metrics = listening_ports(objects, pod).get("metrics")
        if exec_ is None:
            problems.append(f"{pod.name}: no preStop drain")
        else:
            ns, _ = parse_kvmesh(exec_["command"][1:])
            if ns is None or ns.command != "drain" or ns.port != metrics:
                problems.append(f"{pod.name}: preStop {exec_['command']} does not drain the metrics port {metrics}")
        cfg, _ = mesh_config(objects, pod)
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        if cfg is not None and grace < drain_bound(cfg, pod.component) + DRAIN_MARGIN:
            problems.append(f"{pod.name}: terminationGracePeriodSeconds {grace} is not above the drain bound "
                            f"{drain_bound(cfg, pod.component):g} s + {DRAIN_MARGIN:g} s")
    return problems


def _check_envoy_drain(objects: list[Obj]) -> list[str]:
    """Envoy's drain follows the gateways': a terminating Envoy keeps the
    streams it carries (preStop sleep) as long as a draining gateway keeps
    them (its drain bound), and kubelet's SIGKILL comes after that."""
    envoy, gateway = pod_of(objects, "envoy"), pod_of(objects, "gateway")
    cfg, _ = mesh_config(objects, gateway)
    if cfg is None:
        return []
    bound = drain_bound(cfg, "gateway")
    sleep = envoy.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = envoy.spec.get("terminationGracePeriodSeconds", 30)
    problems = []
    if sleep < bound:
        problems.append(f"{envoy.name}: preStop sleeps {sleep} s, less than the gateways' drain bound {bound:g} s "
                        "(an Envoy rollout would cut streams a gateway drain keeps)")
    if grace < sleep + DRAIN_MARGIN:
        problems.append(f"{envoy.name}: terminationGracePeriodSeconds {grace} is not above its preStop sleep "
                        f"{sleep} s + {DRAIN_MARGIN:g} s")
    return problems


# ------------------------------------------------------------------ engine identity


def check_engine_identity(objects: list[Obj]) -> list[str]:
    """Engine id = pod name; announced address = the pod's DNS name under
    the StatefulSet's headless Service, and its gRPC port."""
    pod = pod_of(objects, "engine")
    problems = []
    sts = pod.workload
    svc = find(objects, "Service", sts["spec"].get("serviceName", ""))
    if sts["kind"] != "StatefulSet" or svc is None or svc["spec"].get("clusterIP") != "None":
        return [f"{pod.name}: engines must be a StatefulSet with a headless serviceName Service"]
    fields = {v["name"]: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
              for v in pod.container.get("env", [])}
    if fields.get("POD_NAME") != "metadata.name" or fields.get("POD_NAMESPACE") != "metadata.namespace":
        problems.append(f"{pod.name}: POD_NAME/POD_NAMESPACE are not the downward API's name/namespace")
    args = pod.container.get("args", [])

    def flag(name: str) -> str | None:
        return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None

    if flag("--engine-id") != "$(POD_NAME)":
        problems.append(f"{pod.name}: --engine-id is {flag('--engine-id')!r}, not $(POD_NAME)")
    grpc = listening_ports(objects, pod).get("grpc")
    want = f"$(POD_NAME).{svc['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:{grpc}"
    if flag("--advertise-address") != want:
        problems.append(f"{pod.name}: --advertise-address is {flag('--advertise-address')!r}, not {want}")
    return problems


# ------------------------------------------------------------------ Envoy


def envoy_bootstrap(objects: list[Obj], pod: Pod) -> dict[str, Any] | None:
    """The bootstrap Envoy's `-c` names, from its ConfigMap."""
    argv = pod.argv()
    if "-c" not in argv:
        return None
    path = Path(argv[argv.index("-c") + 1])
    found = _mounted_file(objects, pod, path)
    return None if found is None else yaml.safe_load(found)


def _mounted_file(objects: list[Obj], pod: Pod, path: Path) -> str | None:
    """A file's content (ConfigMap data or binaryData / Secret key name) if a
    volume mounted in the container provides it; None otherwise."""
    for mount in pod.container.get("volumeMounts", []):
        base = Path(mount["mountPath"])
        if base not in path.parents:
            continue
        key = str(path.relative_to(base))
        vol = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
        if "configMap" in vol:
            cm = find(objects, "ConfigMap", vol["configMap"]["name"]) or {}
            data = {**cm.get("data", {}), **cm.get("binaryData", {})}
            if key in data:
                return str(data[key])
        if "secret" in vol:
            items = vol["secret"].get("items")
            if items is None or key in {i["path"] for i in items}:
                return f"<secret {vol['secret']['secretName']}>"
    return None


def _gateway_clusters(objects: list[Obj], boot: dict[str, Any]) -> list[str]:
    gw = pod_of(objects, "gateway")
    want = listening_ports(objects, gw)
    problems = []
    gateway_clusters = [c for c in boot["static_resources"]["clusters"] if c["name"] in (GRPC_CLUSTER, HTTP_CLUSTER)]
    if len(gateway_clusters) != 2:
        problems.append(f"Envoy's bootstrap lacks the clusters {GRPC_CLUSTER} and {HTTP_CLUSTER}")
    for cluster in gateway_clusters:
        role = "grpc" if "http2_protocol_options" in str(cluster["typed_extension_protocol_options"]) else "http"
        dns = cluster.get("cluster_type", {}).get("typed_config", {})
        if cluster.get("cluster_type", {}).get("name") != "envoy.clusters.dns" or \
                dns.get("all_addresses_in_single_endpoint", False):
            problems.append(f"Envoy cluster {cluster['name']}: not strict DNS (every address a gateway)")
        for group in cluster["load_assignment"]["endpoints"]:
            for ep in group["lb_endpoints"]:
                addr = ep["endpoint"]["address"]["socket_address"]
                target = service_target(objects, f"{addr['address']}:{addr['port_value']}")
                svc = find(objects, "Service", addr["address"].split(".")[0])
                if target != ("gateway", want.get(role)):
                    problems.append(f"Envoy cluster {cluster['name']}: {addr['address']}:{addr['port_value']} "
                                    f"is not the gateways' {role} port {want.get(role)}")
                elif svc is None or svc["spec"].get("clusterIP") != "None":
                    problems.append(f"Envoy cluster {cluster['name']}: {addr['address']} is not headless")
    return problems


def check_envoy(objects: list[Obj]) -> list[str]:
    pod = pod_of(objects, "envoy")
    boot = envoy_bootstrap(objects, pod)
    if boot is None:
        return [f"{pod.name}: its -c bootstrap is no file of a mounted ConfigMap"]
    problems = _gateway_clusters(objects, boot)
    text = yaml.safe_dump(boot)
    files = set(re.findall(r"filename: (\S+)", text)) | set(re.findall(r"proto_descriptor: (\S+)", text))
    for filename in sorted(files):
        if _mounted_file(objects, pod, Path(filename)) is None:
            problems.append(f"{pod.name}: Envoy reads {filename}, which no mounted volume provides")
    return problems


# ------------------------------------------------------------------ NetworkPolicy


def policy_allows(objects: list[Obj], source: dict[str, str] | None, source_ns: str, dest: str, port: int) -> bool:
    """Whether the namespace's NetworkPolicies let a pod with labels
    `source` (None = a client outside the cluster) in namespace
    `source_ns` reach component `dest` on `port`."""
    ns = namespace(objects)
    labels = pod_of(objects, dest).workload["spec"]["template"]["metadata"]["labels"]
    ns_labels = {"kubernetes.io/metadata.name": source_ns}
    chosen = [p for p in objects if p["kind"] == "NetworkPolicy"
              and _matches(p["spec"]["podSelector"], labels) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not chosen:
        return True
    for policy in chosen:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(_port_matches(objects, dest, p, port) for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source, source_ns, ns, ns_labels) for peer in peers):
                return True
    return False


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        present = expr["key"] in labels
        value = labels.get(expr["key"])
        op = expr["operator"]
        if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]) or \
                (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def _port_matches(objects: list[Obj], dest: str, rule_port: dict[str, Any], port: int) -> bool:
    value = rule_port.get("port")
    if value is None:
        return True
    return resolve_port(pod_of(objects, dest), value) == port


def _peer_matches(peer: dict[str, Any], source: dict[str, str] | None, source_ns: str, ns: str,
                  ns_labels: dict[str, str]) -> bool:
    if "ipBlock" in peer:
        return source is None  # only "anywhere" blocks are used for clients outside
    if source is None:
        return False
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], ns_labels):
            return False
        return _matches(peer.get("podSelector", {}), source)
    return source_ns == ns and _matches(peer["podSelector"], source)
