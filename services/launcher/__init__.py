"""`kvmesh up`: the whole mesh on one machine, supervised (see mesh.py)."""
