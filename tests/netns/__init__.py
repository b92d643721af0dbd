"""Multi-host tests on one machine: each host a network namespace (harness.py),
the real services running on them (mesh.py), silent partitions and their
safety rules (test_netns_*.py). Needs root and `ip netns`; skipped otherwise."""
