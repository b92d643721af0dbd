"""Operator tools run against a live mesh: `kvmesh admin` (the scheduler's
Admin service, admin_cli.py) and `kvmesh top` (a live terminal view:
top_data.py gathers, top_render.py draws, top_cli.py loops)."""
