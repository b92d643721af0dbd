"""The kvmesh scheduler: priority queues with aging and tenant fairness,
admission control, the engine registry and KV index, pluggable placement,
block reservations and leases. Control plane only: tokens never pass here.

Entry points: `services.scheduler.server.SchedulerService` and
`services.scheduler.server.serve`.
"""

__all__: list[str] = []
