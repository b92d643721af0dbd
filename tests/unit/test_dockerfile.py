"""The Dockerfile, read (no container runtime here to build it): targets, user,
entrypoint, no baked models, and every RUN a step of scripts/install/ that
scripts/setup.sh runs too (one truth for the dev machine and the images)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install"
TARGETS = ("cpu", "gpu")


@dataclass
class Stage:
    name: str
    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


def _stages() -> dict[str, Stage]:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            words = value.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"every stage is named: FROM {value}"
            current = Stage(name=words[2], parent=words[0])
            assert current.name not in stages, f"stage {current.name} twice"
            stages[current.name] = current
        elif current is not None and instruction != "COMMENT":
            current.instructions.append((instruction, value))
    return stages


def _args(value: str) -> list[str]:
    """A RUN/ENTRYPOINT/CMD value as its argument list (exec or shell form)."""
    return json.loads(value) if value.lstrip().startswith("[") else shlex.split(value)


def _lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    chain = []
    while name in stages:
        chain.append(stages[name])
        name = stages[name].parent
    return chain


def _setup_steps() -> list[str]:
    """The scripts/install steps scripts/setup.sh runs, in order."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    return re.findall(r'^"\$I/([\w-]+\.sh)"', text, flags=re.MULTILINE)


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def test_targets_cpu_and_gpu_and_cpu_is_the_default() -> None:
    stages = _stages()
    assert set(TARGETS) <= set(stages)
    assert list(stages)[-1] == "cpu", "a plain `docker build .` gives the dev/CI image"


def test_base_image_matches_this_python_and_debian() -> None:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    image = parser.parent_images[0]
    match = re.fullmatch(r"python:(\d+\.\d+)-slim-(\w+)", image)
    assert match, f"base is Debian's python slim image, not {image}"
    assert match.group(1) == f"{sys.version_info.major}.{sys.version_info.minor}"
    os_release = Path("/etc/os-release")
    if os_release.exists() and "ID=debian" in os_release.read_text():
        assert f"VERSION_CODENAME={match.group(2)}" in os_release.read_text()


@pytest.mark.parametrize("target", TARGETS)
def test_final_stage_runs_kvmesh_as_non_root_with_models_mounted(target: str) -> None:
    stage = _stages()[target]
    users = stage.values("USER")
    assert users, f"{target} sets its USER"
    uid = users[-1].split(":")[0]
    assert uid == "10001", "uid 10001, as the manifests' securityContext runAsUser"
    assert [_args(v) for v in stage.values("ENTRYPOINT")][-1] == ["kvmesh"]
    volumes = [p for v in stage.values("VOLUME") for p in _args(v)]
    assert "/models" in volumes
    assert not any(k.startswith("KVMESH_CONFIG=") for v in stage.values("ENV") for k in v.split()), (
        "the config path comes from the manifests (KVMESH_CONFIG), not baked into the image"
    )


@pytest.mark.parametrize("target", TARGETS)
def test_final_stage_installs_its_own_accelerator_build_and_no_test_deps(target: str) -> None:
    stages = _stages()
    runs = [_args(v) for s in _lineage(stages, target) for v in s.values("RUN")]
    copies = stages[target].values("COPY")
    assert any(c.startswith(f"--from=build-{target} ") for c in copies), "the runtime copies its own build"
    build_runs = [_args(v) for s in _lineage(stages, f"build-{target}") for v in s.values("RUN")]
    deps = [r for r in build_runs if r[0].endswith("/python-deps.sh")]
    assert deps == [["scripts/install/python-deps.sh", target]], "the runtime extra of one accelerator only"
    system = [r for r in runs if r[0].endswith("/system-packages.sh")]
    assert system == [["scripts/install/system-packages.sh", "runtime", target, "--slim"]]
    for r in runs + build_runs:
        assert "test" not in r[1:], f"no test profile or test extra in an image: {r}"


def test_every_run_is_one_install_step_that_setup_also_runs() -> None:
    setup = set(_setup_steps())
    for stage in _stages().values():
        for value in stage.values("RUN"):
            assert not re.search(r"[;&|`$<>]", value), f"RUN calls a script, no inline shell: {value}"
            args = _args(value)
            script = ROOT / args[0]
            assert args[0].startswith("scripts/install/") and script.suffix == ".sh", value
            assert script.is_file(), f"{args[0]} does not exist"
            assert script.stat().st_mode & 0o111, f"{args[0]} is not executable"
            assert script.name in setup, f"{script.name} runs in the image but not in scripts/setup.sh"


def test_setup_runs_every_install_step() -> None:
    steps = _setup_steps()
    scripts = sorted(p.name for p in INSTALL.glob("*.sh") if p.name != "common.sh")
    assert sorted(steps) == scripts
    assert steps[0] == "python-env.sh", "the venv first"


def test_no_model_or_local_state_is_copied() -> None:
    for stage in _stages().values():
        for value in stage.values("COPY") + stage.values("ADD"):
            sources = [w for w in shlex.split(value) if not w.startswith("--")][:-1]
            for src in sources:
                assert not re.search(r"(^|/)\.?(models|venv|run)(/|$)", src), f"COPY of local state: {value}"
    ignored = set(_dockerignore())
    assert {".venv", ".models", ".run", ".git", "tests"} <= ignored



def test_build_context_keeps_what_the_services_read() -> None:
    # The code finds config/, envoy/ and web/ beside services/ (editable install
    # at /opt/kvmesh); setuptools needs README.md (pyproject's readme).
    ignored = _dockerignore()
    for needed in ("services", "config", "envoy", "web", "scripts", "pyproject.toml", "README.md"):
        assert (ROOT / needed).exists()
        assert not any(needed == pattern or needed.startswith(pattern + "/") for pattern in ignored), needed
