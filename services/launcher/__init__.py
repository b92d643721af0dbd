"""`kvmesh up`: the whole mesh on one machine, supervised.

up.py is the command (print how to use the mesh, restart policy and backoff);
mesh.py is the public surface (`Mesh`, `MeshOptions`, `start_on_free_ports`),
built from resolve.py (the config children read), port_plan.py and ports.py
(ports), specs.py (child processes), envoy_config.py (Envoy's bootstrap) and
supervisor.py (process groups, health waits, stop order).
"""
