"""Dashboards and alert rules as code, and the tools that check them against a
real Prometheus.

One source of truth for every PromQL query an operator sees: the Grafana
boards (`boards/`, one module per board over the panel helper `panels.py`),
the alert rules (`alerts.py`), and the files rendered from them (`render.py`:
deploy/overlays/monitoring/dashboards/*.json, the PrometheusRule and the plain
Prometheus rules file). The tests evaluate exactly these queries through a
real Prometheus scraping a running mesh (`local_prometheus.py`, `prom_api.py`),
and `snapshot.py` draws each board from Prometheus data as a PNG.

    kvmesh dashboards render            rewrite the checked-in files (make dashboards)
    kvmesh dashboards snapshot --prometheus URL --out DIR
    kvmesh dashboards demo --out DIR    sim mesh + Prometheus + load -> PNGs
"""
