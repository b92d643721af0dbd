"""The soak (scripts/soak.py): mixed traffic, faults, resource series."""
