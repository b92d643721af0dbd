"""The rules file passes `promtool check rules`, and the key alerts fire on
the series they are written for (`promtool test rules`,
promtool/kvmesh.rules.test.yaml) -- and stop firing when the threshold moves."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.observability.alerts import rules_document
from services.observability.render import PROMETHEUS_RULE, RULES_FILE

ROOT = Path(__file__).resolve().parents[2]
UNIT_TESTS = Path(__file__).parent / "promtool" / "kvmesh.rules.test.yaml"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian `prometheus`: make setup)")


def _promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], check=False, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules_file_and_the_prometheus_rule_spec(tmp_path: Path) -> None:
    result = _promtool("check", "rules", ROOT / RULES_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    spec = tmp_path / "spec.rules.yaml"
    spec.write_text(yaml.safe_dump(yaml.safe_load((ROOT / PROMETHEUS_RULE).read_text())["spec"]))
    result = _promtool("check", "rules", spec)
    assert result.returncode == 0, result.stdout + result.stderr


def test_key_alerts_fire_on_their_series() -> None:
    result = _promtool("test", "rules", UNIT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_fail_when_a_threshold_moves(tmp_path: Path) -> None:
    """The same cases against rules with a 2 s P0 target: the P0 TTFT case
    (p99 ~ 1 s) no longer fires and promtool fails on it; the others pass."""
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.alerts.p0_ttft_p99_seconds = 2.0
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_document(config.alerts), sort_keys=False))
    cases = yaml.safe_load(UNIT_TESTS.read_text())
    cases["rule_files"] = [str(rules)]
    test_file = tmp_path / "cases.yaml"
    test_file.write_text(yaml.safe_dump(cases, sort_keys=False))
    result = _promtool("test", "rules", test_file)
    assert result.returncode != 0
    assert "KvmeshP0TtftAboveTarget" in result.stdout + result.stderr
    assert "KvmeshQueueWaitNearAgingBound" not in result.stdout + result.stderr
