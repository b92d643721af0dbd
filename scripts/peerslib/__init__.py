"""Parts of the routers-side-by-side benchmark (scripts/bench_peers.py) kept
apart so they can be unit-tested without a mesh.

    replicas.py    several scheduler replicas (issue 27): the meshes to
                   start, each run's label, and the table comparing N
                   schedulers with one
"""
