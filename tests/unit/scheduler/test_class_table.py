"""Priority classes as data (services/scheduler/classes.py): one closed enum,
one table of what each class may do built from the config, and no scheduler
module outside it that tests for "is this a batch line"."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.common.config import SchedulerConfig
from services.scheduler.classes import (
    CapScope,
    ClassTable,
    PriorityClass,
    admitted_priority,
    class_of,
    class_problems,
    wire_batch,
)
from services.scheduler.records import NUM_CLASSES, AdmitOptions

SCHEDULER = Path(__file__).resolve().parents[3] / "services" / "scheduler"

# The table itself: the one module that may name a class or read the flag.
TABLE_MODULES = frozenset({"classes.py"})
# The admission boundary: grpc_api.py turns AdmitRequest.batch into
# AdmitOptions (whose class classes.class_of derives) and a queue's class
# back into QueueState.batch. Exactly these source fragments, nothing else.
# records.py declares that field of AdmitOptions (the wire's summary).
BOUNDARY: dict[str, frozenset[str]] = {
    "grpc_api.py": frozenset({"msg.batch", "batch=msg.batch", "batch=wire_batch(q.klass)", "wire_batch"}),
    "records.py": frozenset({"batch"}),
    # Not a batch line: planning's EngineLoad.batch, the mean number of
    # sequences an engine decodes at once (services/planning/engine_model.py).
    "scaling/policy.py": frozenset({"option.load.batch"}),
}
# What "tests for a batch line" looks like in code: the wire flag, a class
# member named BATCH, an is_batch helper, the class's enum value, the
# inverse of the boundary's conversion.
FLAG_ATTRS = frozenset({"batch", "is_batch", "BATCH"})
FLAG_NAMES = frozenset({"batch", "is_batch", "BATCH", "wire_batch"})
FLAG_STRINGS = frozenset({"batch"})


def batch_tests(source: str) -> list[tuple[int, str]]:
    """(line, source fragment) of every place `source` reads the batch flag
    or names the batch class: attribute access, names, `batch=` keywords,
    getattr-style strings (docstrings and comments do not count)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        hit = (
            (isinstance(node, ast.Attribute) and node.attr in FLAG_ATTRS)
            or (isinstance(node, ast.Name) and node.id in FLAG_NAMES)
            or (isinstance(node, (ast.keyword, ast.arg)) and node.arg in FLAG_NAMES | FLAG_ATTRS)
            or (isinstance(node, ast.alias) and (node.asname or node.name) in FLAG_NAMES)
            or (isinstance(node, ast.Constant) and node.value in FLAG_STRINGS and id(node) not in docstrings)
        )
        if hit:
            line: int = getattr(node, "lineno", 0)
            found.append((line, ast.get_source_segment(source, node) or getattr(node, "name", "") or str(line)))
    return found


def test_no_scheduler_module_outside_the_class_table_tests_for_a_batch_line() -> None:
    offenders = []
    modules = sorted(SCHEDULER.rglob("*.py"))
    assert len(modules) > 40, "the scan must see the whole scheduler"
    for path in modules:
        relative = path.relative_to(SCHEDULER).as_posix()
        if relative in TABLE_MODULES:
            continue
        allowed = BOUNDARY.get(relative, frozenset())
        offenders += [f"services/scheduler/{relative}:{line}: {segment}"
                      for line, segment in batch_tests(path.read_text()) if segment not in allowed]
    assert offenders == [], "read the class's rules (classes.py) instead:\n" + "\n".join(offenders)


def test_the_boundary_allow_list_is_not_stale() -> None:
    for relative, allowed in BOUNDARY.items():
        seen = {segment for _, segment in batch_tests((SCHEDULER / relative).read_text())}
        assert allowed <= seen, f"{relative}: allowed but gone: {sorted(allowed - seen)}"


@pytest.mark.parametrize("snippet", [
    "if rec.options.batch:\n    pass",
    "x = rec.klass is PriorityClass.BATCH",
    "from .classes import PriorityClass\nflag = PriorityClass('batch')",
    "flag = getattr(options, 'batch')",
    "opts = AdmitOptions(request_id='r', batch=True)",
    "def f(rec):\n    return rec.is_batch()",
    "from .classes import wire_batch\nflag = wire_batch(k)",
    "BATCH = 3\nif cls == BATCH:\n    pass",
    "def preempted(cls, batch=False):\n    return cls",
    "for line in lines:\n    if line.batch: pass",
])
def test_the_scan_finds_each_way_of_testing_for_a_batch_line(snippet: str) -> None:
    assert batch_tests(snippet), snippet


@pytest.mark.parametrize("snippet", [
    '"""Batch lines yield: "batch" in a docstring is prose."""\nx = 1',
    "# if rec.options.batch: a comment\nx = 1",
    "deadline = options.batch_deadline_unix",
    "if rules.expendable or rules.cap_scope is CapScope.OWN:\n    pass",
    "metrics.batch_queued.set(n)",
])
def test_the_scan_leaves_prose_and_other_names_alone(snippet: str) -> None:
    assert batch_tests(snippet) == [], snippet


# ---------------------------------------------------------------- the table

def test_every_class_has_one_row_and_the_ladder_is_ranked_by_number_not_enum_order() -> None:
    table = ClassTable.from_config(SchedulerConfig())
    assert set(table) == set(PriorityClass)
    assert [table[k].rank for k in ClassTable.ladder()] == list(range(NUM_CLASSES))
    assert all(table.at_rank(r).klass is k for r, k in enumerate(ClassTable.ladder()))
    with pytest.raises(TypeError):
        _ = PriorityClass.P0 < PriorityClass.P1  # closed enum: no order


def test_the_numbers_come_from_the_scheduler_config() -> None:
    config = SchedulerConfig(queue_caps=[5, 6, 7], queue_ttl_seconds=[10.0, 20.0, 30.0], batch_queue_cap=9,
                             preempt_classes=[0, 1])
    config.aging.p1_seconds, config.aging.p2_seconds = 11.0, 13.0
    table = ClassTable.from_config(config)
    rows = {k: (r.queue_cap, r.ttl_seconds, r.aging_seconds, r.aging_to_top_seconds) for k, r in table.items()}
    assert rows == {
        PriorityClass.P0: (5, 10.0, None, 0.0),
        PriorityClass.P1: (6, 20.0, 11.0, 11.0),
        PriorityClass.P2: (7, 30.0, 13.0, 24.0),
        PriorityClass.BATCH: (9, 30.0, None, 0.0),   # its TTL when its batch sets no deadline: P2's
    }
    assert [table.preempts(k, r) for k in (PriorityClass.P1, PriorityClass.BATCH) for r in (0, 1, 2)] == [
        True, True, False, False, False, False]


def test_what_a_batch_line_may_do_is_its_row() -> None:
    table = ClassTable.from_config(SchedulerConfig())
    batch, p2 = table[PriorityClass.BATCH], table[PriorityClass.P2]
    assert (batch.rank, batch.label) == (p2.rank, p2.label) == (2, "P2")
    assert (batch.ages, batch.cap_scope, batch.ttl_from_deadline, batch.derived_queue_bound) == (
        False, CapScope.OWN, True, False)
    assert (batch.expendable, batch.yields_room, batch.reserved_slots, batch.delays_p0, batch.apart) == (
        True, True, False, False, True)
    for k in ClassTable.ladder():
        rules = table[k]
        assert (rules.ages, rules.cap_scope, rules.expendable, rules.yields_room, rules.reserved_slots,
                rules.delays_p0, rules.apart) == (True, CapScope.CLASS_NOW, False, False, True, True, False), k
    assert table.apart() == [PriorityClass.BATCH]


@pytest.mark.parametrize(("priority", "batch", "klass"), [
    (0, False, PriorityClass.P0), (1, False, PriorityClass.P1), (2, False, PriorityClass.P2),
    (2, True, PriorityClass.BATCH),
])
def test_the_class_is_derived_from_the_wire_in_one_place_and_back(priority: int, batch: bool,
                                                                   klass: PriorityClass) -> None:
    options = AdmitOptions(request_id="r", model="m", priority=priority, prompt_tokens=1, batch=batch)
    assert class_problems(options) == []
    assert class_of(options) is options.klass is klass
    assert wire_batch(klass) is batch
    assert admitted_priority(0, batch) == (2 if batch else 0)


@pytest.mark.parametrize(("priority", "batch", "problem"), [
    (3, False, "priority 3 is not in 0..2"), (-1, True, "priority -1 is not in 0..2"),
    (0, True, "a batch line runs as P2, got priority 0"),
])
def test_class_problems_say_what_to_change(priority: int, batch: bool, problem: str) -> None:
    options = AdmitOptions(request_id="r", model="m", priority=priority, prompt_tokens=1, batch=batch)
    assert class_problems(options) == [problem]
