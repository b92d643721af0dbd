"""The launcher's Mesh without the real services: config resolution (ports,
API key, model), the printed examples, and the supervisor mechanics (health
waits, a child dying, kill, restart, stop) over tiny fake children."""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
import yaml

from services.batch.credential import CREDENTIAL_ENV
from services.common.config import ConfigError, load_config
from services.launcher.children import RestartPolicy
from services.launcher.mesh import (
    ChildSpec,
    Mesh,
    MeshError,
    MeshOptions,
    Probe,
    ProbeKind,
    Role,
)
from services.launcher.ports import PortAllocator, free_port, free_port_block, port_is_free
from services.launcher.probes import probe_ok
from services.launcher.up import Restarts, examples

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "config" / "kvmesh.yaml"

HEALTHY_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from services.common.grpc_server import make_server
    async def main():
        server, health = make_server([])
        server.add_insecure_port("127.0.0.1:" + sys.argv[1])
        await server.start()
        await health.set_serving(True)
        print("serving", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())
    """
)


def _mesh(tmp_path: Path, **kw: object) -> Mesh:
    options = MeshOptions(free_ports=True, run_dir=tmp_path, model="tiny-llama", **kw)  # type: ignore[arg-type]
    return Mesh(load_config(CONFIG), options)


def _needs_tiny_llama() -> None:
    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama not built yet (make setup)")


def test_free_port_block_is_consecutive_and_free() -> None:
    base = free_port_block(4)
    assert all(port_is_free(base + i) for i in range(4))
    assert port_is_free(free_port())


def test_a_mesh_never_hands_out_one_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probing finds a port free until a child binds it, so two probes can
    find the same one: the allocator must remember what it gave away."""
    import services.launcher.ports as ports

    fixed = iter([25720, 25720, 25720, 25722, 25730, 40001, 40001, 40002])
    monkeypatch.setattr(ports.random.Random, "randrange", lambda _self, _low, _high: next(fixed))
    monkeypatch.setattr(ports, "free_port", lambda _host="127.0.0.1": next(fixed))
    monkeypatch.setattr(ports, "port_is_free", lambda _port, _host="127.0.0.1": True)
    alloc = PortAllocator()
    first = alloc.block(2)
    second = alloc.block(2)
    third = alloc.block(2)
    assert (first, second, third) == (25720, 25722, 25730)  # 25720 again (and 25721): skipped
    assert alloc.one() == 40001 and alloc.one() == 40002


def test_resolved_config_has_free_ports_key_and_model(tmp_path: Path) -> None:
    _needs_tiny_llama()
    mesh = _mesh(tmp_path, engines=3, gateways=2, api_key="sekret")
    cfg = mesh.config
    assert cfg.engines.count == 3
    assert cfg.engines.template.model == "tiny-llama"
    assert cfg.gateway.scheduler_address == f"127.0.0.1:{cfg.scheduler.port}"
    assert cfg.envoy.port != 8080 and cfg.scheduler.port != 50051
    digest = hashlib.sha256(b"sekret").hexdigest()
    assert [k.tenant for k in cfg.gateway.api_keys if k.sha256 == digest] == ["dev"]
    assert len(mesh.endpoints.engines) == 3 and len(mesh.endpoints.gateway_grpc) == 2
    assert Path(cfg.run_dir) == tmp_path
    assert all(Path(m.path).is_absolute() for m in cfg.models)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_front_cores_are_the_ones_vllm_leaves(tmp_path: Path) -> None:
    """vLLM engines pinned to "1": Envoy, gateways, scheduler and engine
    services get every other core; sim engines or unpinned vLLM: no pinning."""
    _needs_tiny_llama()
    config = load_config(CONFIG)
    config.engines.template.vllm.omp_threads_bind = "1"
    options = MeshOptions(free_ports=True, run_dir=tmp_path, model="tiny-llama", backend="vllm")
    assert Mesh(config, options).front_cores == os.sched_getaffinity(0) - {1}
    config.engines.template.vllm.pin_vllm_processes = False
    assert Mesh(config, options).front_cores == set()
    config.engines.template.vllm.pin_vllm_processes = True
    config.engines.template.vllm.omp_threads_bind = "auto"  # vLLM's own choice: nothing to plan around
    assert Mesh(config, options).front_cores == set()
    assert _mesh(tmp_path, backend="sim").front_cores == set()


def test_generated_key_when_none_given(tmp_path: Path) -> None:
    _needs_tiny_llama()
    a, b = _mesh(tmp_path), _mesh(tmp_path)
    assert a.api_key and a.api_key != b.api_key


def test_admin_token_generated_or_given_hashed_into_the_config_and_written_owner_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _needs_tiny_llama()
    a, b = _mesh(tmp_path / "a"), _mesh(tmp_path / "b")
    assert a.admin_token and a.admin_token != b.admin_token
    digest = hashlib.sha256(a.admin_token.encode()).hexdigest()
    assert [(k.name, k.sha256) for k in a.config.scheduler.admin_keys] == [("kvmesh-up", digest)]
    given = _mesh(tmp_path / "c", admin_token="ops-token")
    assert given.admin_token == "ops-token"
    given._write_files()
    token_file = given.files.admin_token_path
    assert token_file.read_text().strip() == "ops-token" and token_file.stat().st_mode & 0o077 == 0
    from services.launcher.up import _print_operator

    _print_operator(given)
    out = capsys.readouterr().out
    assert "Admin token (yours" in out and "ops-token" in out
    # The printed commands parse with kvmesh's own parser, as a user pastes them.
    from services.cli import _parser

    lines = [line.split() for line in out.splitlines() if " top " in line or " pause P2" in line]
    assert len(lines) == 2
    for words in lines:
        at = next(i for i, w in enumerate(words) if w == "--config")
        args = _parser().parse_args(words[at:])
        assert args.config == str(given.config_path)
    assert f"--token-file {token_file} pause P2" in out


def test_unknown_model_and_bad_counts_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no model named 'nope'"):
        Mesh(load_config(CONFIG), MeshOptions(model="nope", run_dir=tmp_path))
    with pytest.raises(ConfigError, match="--gateways"):
        Mesh(load_config(CONFIG), MeshOptions(gateways=0, run_dir=tmp_path))


def test_specs_pass_the_resolved_config_and_ports(tmp_path: Path) -> None:
    _needs_tiny_llama()
    mesh = _mesh(tmp_path, engines=2, gateways=2)
    specs = {s.name: s for s in mesh.specs()}
    assert list(specs) == ["scheduler", "engine-0", "engine-1", "batch", "gateway-0", "gateway-1", "envoy"]
    for spec in specs.values():
        if spec.role is not Role.ENVOY:
            assert spec.argv[spec.argv.index("--config") + 1] == str(mesh.config_path)
    gw1 = specs["gateway-1"].argv
    assert gw1[gw1.index("--grpc-port") + 1] == str(mesh.config.gateway.grpc_port + 1)
    assert specs["engine-1"].argv[-2:] == ["--index", "1"]
    assert "--use-dynamic-base-id" in specs["envoy"].argv


def test_the_batch_service_gets_its_credential_and_sends_lines_through_envoy(tmp_path: Path) -> None:
    """One supervised batch process; the run's internal credential reaches
    it by environment only (the config holds its hash, which the gateways
    read); its lines go to Envoy's listener; Envoy routes to its port."""
    _needs_tiny_llama()
    mesh = _mesh(tmp_path, engines=1)
    spec = {s.name: s for s in mesh.specs()}["batch"]
    assert spec.role is Role.BATCH and spec.restart is RestartPolicy.ALWAYS
    assert spec.argv[-1] == "batch"
    credential = spec.env[CREDENTIAL_ENV]
    batch = mesh.config.batch
    assert batch.internal_key_sha256 == hashlib.sha256(credential.encode()).hexdigest()
    assert batch.gateway_url == mesh.endpoints.public_http
    assert mesh.endpoints.batch_http == f"http://127.0.0.1:{batch.port}"
    mesh._write_files()
    assert credential not in mesh.config_path.read_text()
    assert load_config(mesh.config_path).batch.internal_key_sha256 == batch.internal_key_sha256
    envoy = yaml.safe_load(mesh.envoy_config_path.read_text())
    cluster = next(c for c in envoy["static_resources"]["clusters"] if c["name"] == "batch_http")
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["port_value"] == batch.port
    off = load_config(CONFIG)
    off.batch.enabled = False
    mesh = Mesh(off, MeshOptions(free_ports=True, run_dir=tmp_path / "off", model="tiny-llama"))
    assert "batch" not in [s.name for s in mesh.specs()] and not mesh.endpoints.batch_http


def test_written_files_load_back(tmp_path: Path) -> None:
    _needs_tiny_llama()
    mesh = _mesh(tmp_path)
    mesh._write_files()  # the files start() writes
    assert load_config(mesh.config_path).scheduler.port == mesh.config.scheduler.port
    envoy = yaml.safe_load(mesh.envoy_config_path.read_text())
    listener = envoy["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == mesh.config.envoy.port


def test_examples_are_valid_shell(tmp_path: Path) -> None:
    _needs_tiny_llama()
    mesh = _mesh(tmp_path, api_key="k'ey")
    ex = examples(mesh.endpoints, mesh.api_key, "tiny-llama")
    curl = shlex.split(ex.curl)
    assert curl[:2] == ["curl", "-N"] and "Authorization: Bearer k'ey" in curl
    assert yaml.safe_load(curl[-1])["stream"] is True
    grpcurl = shlex.split(ex.grpcurl)
    assert grpcurl[-1] == "kvmesh.v1.Inference/Chat"
    assert grpcurl[-2] == f"127.0.0.1:{mesh.config.envoy.port}"


# ---------------------------------------------------------------- supervisor


class FakeMesh(Mesh):
    """A Mesh whose children are tiny Python processes."""

    fake_specs: list[ChildSpec]

    def specs(self) -> list[ChildSpec]:
        return self.fake_specs


def _healthy(name: str, role: Role, port: int, mesh: Mesh) -> ChildSpec:
    return ChildSpec(name=name, role=role, argv=[sys.executable, "-c", HEALTHY_CHILD, str(port)],
                     probes=[Probe(ProbeKind.GRPC_HEALTH, f"127.0.0.1:{port}")],
                     env=mesh._env(), start_timeout=60)


def _fake(tmp_path: Path) -> FakeMesh:
    _needs_tiny_llama()
    return FakeMesh(load_config(CONFIG), MeshOptions(free_ports=True, run_dir=tmp_path, envoy=False,
                                                      model="tiny-llama"))


def test_start_kill_restart_and_stop(tmp_path: Path) -> None:
    mesh = _fake(tmp_path)
    mesh.fake_specs = [_healthy("scheduler", Role.SCHEDULER, free_port(), mesh),
                       _healthy("engine-0", Role.ENGINE, free_port(), mesh)]
    mesh.start()
    try:
        assert mesh.is_running("scheduler") and mesh.is_running("engine-0")
        assert mesh.exited() == []
        mesh.kill("engine-0")
        assert not mesh.is_running("engine-0")
        assert mesh.exited() == []  # a kill we asked for is not a surprise
        mesh.restart("engine-0")
        assert mesh.is_running("engine-0")
        assert "serving" in mesh.log_tail("engine-0")
    finally:
        mesh.stop_all()
    assert not mesh.is_running("scheduler") and not mesh.is_running("engine-0")


def test_an_engine_that_dies_is_restarted_with_its_name_and_port(tmp_path: Path) -> None:
    """What `kvmesh up` does when an engine exits by itself (its backend died
    or hung): the supervision passes restart it, healthy on the same port."""
    mesh = _fake(tmp_path)
    policy = {spec.role: spec.restart for spec in Mesh.specs(mesh)}  # the real specs' policies
    port = free_port()
    engine = _healthy("engine-0", Role.ENGINE, port, mesh)
    engine.restart = policy[Role.ENGINE]
    gateway = _healthy("gateway-0", Role.GATEWAY, free_port(), mesh)
    gateway.restart = policy[Role.GATEWAY]
    mesh.fake_specs = [_healthy("scheduler", Role.SCHEDULER, free_port(), mesh), engine, gateway]
    mesh.start()
    try:
        restarts = Restarts(mesh)
        old = mesh.pid("engine-0")
        assert old is not None
        os.kill(old, signal.SIGKILL)  # as if it exited 3 after its backend died
        mesh._children["engine-0"].process.wait()
        deadline = time.monotonic() + 60
        while not restarts.restarted and time.monotonic() < deadline:
            restarts.check()
            time.sleep(0.1)
        assert restarts.restarted == ["engine-0"] and [(e.name, e.returncode) for e in restarts.exits] == [
            ("engine-0", -9)]
        assert mesh.is_running("engine-0") and mesh.pid("engine-0") != old
        channels: dict[str, grpc.Channel] = {}
        assert probe_ok(Probe(ProbeKind.GRPC_HEALTH, f"127.0.0.1:{port}"), channels)  # same port, healthy
        for channel in channels.values():
            channel.close()
        gateway_pid = mesh.pid("gateway-0")
        assert gateway_pid is not None
        os.kill(gateway_pid, signal.SIGKILL)
        mesh._children["gateway-0"].process.wait()
        restarts.check()
        assert restarts.restarted == ["engine-0"] and not mesh.is_running("gateway-0")  # reported only
    finally:
        mesh.stop_all()


def test_a_child_dying_on_its_own_is_reported(tmp_path: Path) -> None:
    mesh = _fake(tmp_path)
    mesh.fake_specs = [_healthy("scheduler", Role.SCHEDULER, free_port(), mesh)]
    mesh.start()
    try:
        pid = mesh.pid("scheduler")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # a crash the mesh did not ask for
        mesh._children["scheduler"].process.wait()
        gone = mesh.exited()
        assert [(g.name, g.returncode) for g in gone] == [("scheduler", -9)]
        assert mesh.exited() == []  # reported once
    finally:
        mesh.stop_all()


def test_a_child_that_dies_at_start_names_itself_and_its_log(tmp_path: Path) -> None:
    mesh = _fake(tmp_path)
    mesh.fake_specs = [
        _healthy("scheduler", Role.SCHEDULER, free_port(), mesh),
        ChildSpec(name="gateway-0", role=Role.GATEWAY,
                  argv=[sys.executable, "-c", "import sys; print('bad setting gateway.x'); sys.exit(3)"],
                  probes=[Probe(ProbeKind.HTTP_OK, f"http://127.0.0.1:{free_port()}/health")],
                  env=mesh._env(), start_timeout=60),
    ]
    with pytest.raises(MeshError) as info:
        mesh.start()
    message = str(info.value)
    assert "gateway-0 exited with code 3" in message
    assert "bad setting gateway.x" in message and "gateway-0.log" in message
    assert not mesh.is_running("scheduler")  # a failed start stops what it started


def test_a_child_that_never_gets_healthy_times_out(tmp_path: Path) -> None:
    mesh = _fake(tmp_path)
    mesh.fake_specs = [ChildSpec(
        name="scheduler", role=Role.SCHEDULER, argv=[sys.executable, "-c", "import time; time.sleep(60)"],
        probes=[Probe(ProbeKind.GRPC_HEALTH, f"127.0.0.1:{free_port()}")], env=mesh._env(),
        start_timeout=1.0,
    )]
    with pytest.raises(MeshError, match="scheduler did not become healthy within 1 s"):
        mesh.start()
    assert not mesh.is_running("scheduler")


def test_a_taken_configured_port_is_named_before_anything_starts(tmp_path: Path) -> None:
    _needs_tiny_llama()
    config = load_config(CONFIG)
    config.scheduler.port, config.scheduler.metrics_port = free_port(), 0
    config.gateway.http_port, config.gateway.grpc_port, config.gateway.metrics_port = free_port(), free_port(), 0
    config.engines.base_port, config.engines.metrics_base_port = free_port_block(1), 0
    config.envoy.port, config.envoy.admin_port = free_port(), free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", config.envoy.port))
        holder.listen()
        mesh = Mesh(config, MeshOptions(engines=1, run_dir=tmp_path, model="tiny-llama"))
        with pytest.raises(MeshError, match=f"envoy.port={config.envoy.port}"):
            mesh.start()
    assert mesh.names == []  # nothing was started


def test_without_envoy_the_examples_point_at_the_gateway(tmp_path: Path) -> None:
    _needs_tiny_llama()
    mesh = _mesh(tmp_path, envoy=False)
    assert [s.name for s in mesh.specs()][-1] == "gateway-0"
    ex = examples(mesh.endpoints, mesh.api_key, "tiny-llama")
    assert f"http://127.0.0.1:{mesh.config.gateway.http_port}/v1/chat/completions" in ex.curl
    assert f"127.0.0.1:{mesh.config.gateway.grpc_port} kvmesh.v1.Inference/Chat" in ex.grpcurl


def test_tls_topology_gets_dev_certificates_and_https_examples(tmp_path: Path) -> None:
    _needs_tiny_llama()
    config = load_config(CONFIG)
    config.envoy.topology = "envoy/topology-tls.yaml"
    mesh = Mesh(config, MeshOptions(free_ports=True, run_dir=tmp_path, model="tiny-llama"))
    mesh._write_files()  # the files start() writes
    ca = tmp_path / "tls" / "ca.pem"
    assert mesh.endpoints.tls_ca == ca and ca.exists()
    assert mesh.endpoints.public_http.startswith("https://127.0.0.1:")
    envoy = yaml.safe_load(mesh.envoy_config_path.read_text())
    tls = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]["typed_config"]
    context = tls["common_tls_context"]
    assert context["alpn_protocols"] == ["h2", "http/1.1"]
    assert context["tls_certificates"][0]["certificate_chain"]["filename"] == str(tmp_path / "tls" / "server.pem")
    assert (tmp_path / "tls" / "server-key.pem").stat().st_mode & 0o077 == 0  # key private to its owner
    ex = examples(mesh.endpoints, mesh.api_key, "tiny-llama")
    assert f"--cacert {ca}" in ex.curl and f"-cacert {ca}" in ex.grpcurl and "-plaintext" not in ex.grpcurl
    envoy_spec = {s.name: s for s in mesh.specs()}["envoy"]
    assert envoy_spec.probes[-1].ca == str(ca)
    # A second mesh in the same run dir keeps the same CA (clients keep trusting it).
    again = Mesh(config, MeshOptions(free_ports=True, run_dir=tmp_path, model="tiny-llama"))
    before = ca.read_bytes()
    again._write_files()
    assert ca.read_bytes() == before


def test_respawn_returns_at_once_and_started_follows_the_child(tmp_path: Path) -> None:
    """The supervision loop's non-blocking restart: `respawn` starts the
    child and returns; `started` answers False while it is not healthy yet,
    True once it is; a child that exits before it is healthy raises (with
    its log), so the loop can try again."""
    mesh = _fake(tmp_path)
    port = free_port()
    slow = _healthy("engine-0", Role.ENGINE, port, mesh)
    mesh.fake_specs = [_healthy("scheduler", Role.SCHEDULER, free_port(), mesh), slow]
    mesh.start()
    try:
        slow.argv = [sys.executable, "-c", "import time; time.sleep(2)\n" + HEALTHY_CHILD, str(port)]
        mesh.kill("engine-0")
        began = time.monotonic()
        mesh.respawn("engine-0")
        assert mesh.started("engine-0") is False and time.monotonic() - began < 2
        deadline = time.monotonic() + 60
        while not mesh.started("engine-0"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert mesh.started("engine-0")  # and from then on
        slow.argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(1)"]
        mesh.kill("engine-0")
        mesh.respawn("engine-0")
        mesh.wait("engine-0", 30)
        with pytest.raises(MeshError, match="engine-0 exited with code 1 before it became healthy"):
            mesh.started("engine-0")
        assert [(e.name, e.returncode) for e in mesh.exited()] == [("engine-0", 1)]
    finally:
        mesh.stop_all()
