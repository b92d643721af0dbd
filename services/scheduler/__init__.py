"""The kvmesh scheduler: priority queues with aging and tenant fairness,
admission control, the engine registry and KV index, pluggable placement,
block reservations and leases. Control plane only: tokens never pass here.

Ownership rule: all mutable scheduler state belongs to one `SchedulerCore`
(core.py), called only from the event loop's thread and only through
`SchedulerCore.handle(event) -> Outbox`, which applies the event, always
dispatches, and returns what to deliver. The core keeps its state in three
objects only it calls: `RequestBook` (request_book.py), `WaitingRoom`
(waiting.py) and `EngineFleet` (fleet.py), plus the per-class counters of
class_stats.py.

What each priority class may do (P0, P1, P2 and Batch API lines: aging,
queue cap, TTL, preemption rank, reserved slots, yielding room, deadline
floors, metric label) is one table, classes.py, built from the config and
read by every phase below; no other module tests for a particular class.

A request's phases and the file that owns each:
  admit     admit.py `Admission`, with admission_limits.py (caps, TTL,
            retry-after), making_room.py (a tenant at its cap: the lowest
            class is displaced), aging.py, waiting.py + queue.py +
            queue_policies.py;
  place     placement/ (filters, scorers, pickers, named policies) over the
            engine views of fleet.py: only the candidates its indexes give
            (placement/candidates.py which and why, fleet_index.py the
            per-model figures kept sorted as reports arrive);
  preempt   making_room.py `RoomMaker.preempt_for` (a preempt-class queue
            head with no room: one lower-class lease ends), the victim rule
            in preemption.py (pure), `RequestBook.preempt`;
  dispatch  dispatch.py `Dispatcher` (aging and TTL, then Replace lanes,
            then queues, in order; placement through batch_yield.py);
            leases and reservations in fleet.py;
  requeue   comebacks.py (Requeue after a preemption, Replace after an
            engine failure);
  finish    request_book.py `RequestBook.finish` (exactly once).
Around them: events.py (what the core accepts and returns), grpc_api.py
(Admit / Connect / GetState streams <-> events; the one place for protobuf
and gRPC status codes), server.py (process: gRPC server, timers, metrics),
engine_registry.py, kv_index.py, reservations.py (the fleet's books),
records.py (records, enums, errors), core_parts.py (the owned state the
phases share), class_stats.py (per-class preemption
and displacement counters for GetState and metrics), metrics.py.

Entry points: `services.scheduler.server.SchedulerService` and
`services.scheduler.server.serve`.
"""

__all__: list[str] = []
