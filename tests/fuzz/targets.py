"""Fuzz targets against a running mesh: what a careless or hostile client
can send to the gateway's HTTP API (schemathesis from /openapi.json, and
hypothesis-built bodies), and what a rogue gRPC client can send to the
gateway's Inference, the scheduler's Admit/Connect/GetState and the engines'
Generate/Abort/GetInfo.

Each target runs `examples` hypothesis cases and RECORDS failures instead of
raising, so one run counts every case tried and every failure found (no
shrinking: the failing input is printed as sent). A failure is a server
fault: an HTTP 5xx, a dropped connection, a gRPC UNKNOWN/INTERNAL/DATA_LOSS
(or UNAVAILABLE from a healthy mesh), an engine `finished` with ERROR, or
a service that exited. `leak_problems` then checks what must be free once
the mesh is idle: 0 leases, 0 queued, engines running 0 and no KV block
pinned (cached prefix blocks are allowed).

Used by tests/fuzz (small example counts) and scripts/fuzz.py (long runs).
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from services.common.config import load_config
from services.common.proto.kvmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.launcher.mesh import Mesh, MeshOptions

__all__ = [
    "TARGETS",
    "FuzzReport",
    "alive_problems",
    "leak_problems",
    "log_problems",
    "run_target",
    "start_fuzz_mesh",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
# gRPC codes a client can never be the cause of.
_SERVER_FAULTS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
                  grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED}
# Failures kept per target (the first ones; the count is exact).
_KEEP = 20


@dataclass
class FuzzReport:
    target: str
    cases: int = 0
    failures: list[str] = field(default_factory=list)
    failure_count: int = 0

    def fail(self, what: str) -> None:
        self.failure_count += 1
        if len(self.failures) < _KEEP:
            self.failures.append(what[:600])

    def summary(self) -> str:
        return f"{self.target}: {self.cases} cases, {self.failure_count} failures"


def _settings(examples: int, seed: int | None) -> settings:
    return settings(
        max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


# ---------------------------------------------------------------- the mesh


def start_fuzz_mesh(run_dir: Path, envoy: bool = False) -> Mesh:
    """Scheduler, two sim engines, one gateway (Envoy optional) on free
    ports. The simulated GPU costs no time (speed_factor 0): a fuzz case
    that asks for thousands of tokens still ends at once."""
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = 0.0
    mesh = Mesh(config, MeshOptions(engines=2, backend="sim", model=MODEL, free_ports=True,
                                    run_dir=run_dir, envoy=envoy))
    mesh.start()
    return mesh


# ---------------------------------------------------------------- mesh checks


def alive_problems(mesh: Mesh) -> list[str]:
    out = [f"{e.name} exited with code {e.returncode}" for e in mesh.exited()]
    out += [f"{n} is not running" for n in mesh.names if not mesh.is_running(n)]
    return out


def log_problems(mesh: Mesh) -> list[str]:
    """Tracebacks in any service's log: a handler that blew up, even if
    the client got a clean status."""
    out = []
    for path in sorted(mesh.log_dir.glob("*.log")):
        text = path.read_text(errors="replace")
        for marker in ("Traceback (most recent call last)", "Task exception was never retrieved"):
            at = text.find(marker)
            if at >= 0:
                out.append(f"{path.name}: {text[at:at + 1500]}")
                break
    return out


def _state(mesh: Mesh) -> scheduler_pb2.SchedulerState:
    with grpc.insecure_channel(mesh.endpoints.scheduler) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=10)


def _engine_info(address: str) -> engine_pb2.EngineInfo:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)


def leak_problems(mesh: Mesh, timeout: float = 30.0) -> list[str]:
    """Wait (up to `timeout`) for the mesh to be idle; what is still held."""
    deadline = time.monotonic() + timeout
    while True:
        problems: list[str] = []
        state = _state(mesh)
        if state.leases_total or state.queued_total:
            problems.append(f"scheduler holds {state.leases_total} leases, {state.queued_total} queued")
        for e in state.engines:
            if e.blocks_reserved or e.leases:
                problems.append(f"scheduler: {e.engine_id} has {e.leases} leases, {e.blocks_reserved} reserved")
        for address in mesh.endpoints.engines:
            info = _engine_info(address)
            if info.running or info.waiting or info.blocks_used:
                problems.append(f"engine {info.engine_id}: running {info.running}, waiting {info.waiting}, "
                                f"blocks_used {info.blocks_used} (cached {info.cached_blocks})")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.1)


# ---------------------------------------------------------------- strategies

_i32 = st.integers(-(2**31), 2**31 - 1)
_u32 = st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))
_u64 = st.integers(0, 2**64 - 1)
_f32 = st.one_of(st.floats(width=32), st.floats(-3, 3, width=32))
_f64 = st.floats()
_text = st.text(max_size=40)
# Strings protobuf will encode (no lone surrogates).
_ptext = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)
_json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**40), 10**40), st.floats(), _text,
)
_json = st.recursive(_json_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(_text, c, max_size=4),
                     max_leaves=12)

_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
           "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
           "n", "stream", "stream_options", "logprobs", "top_logprobs", "response_format", "tools",
           "echo", "suffix", "best_of", "user"]


# ---------------------------------------------------------------- HTTP


def _http_base(mesh: Mesh) -> str:
    return mesh.endpoints.gateway_http[0]


def _check_http(report: FuzzReport, what: str, send: Callable[[], httpx.Response]) -> None:
    try:
        resp = send()
    except httpx.HTTPError as exc:
        report.fail(f"{what}: transport error {exc!r}")
        return
    if resp.status_code >= 500:
        report.fail(f"{what}: HTTP {resp.status_code}: {resp.text[:300]}")
        return
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
            if not isinstance(err.get("message"), str) or not err["message"]:
                raise KeyError("message")
        except (ValueError, KeyError, TypeError):
            report.fail(f"{what}: HTTP {resp.status_code} without an OpenAI error body: {resp.text[:200]}")
        return
    # 200 with SSE: an in-band error event is a failure of the request only
    # if it is a server fault; generation errors are never expected here.
    if "text/event-stream" in resp.headers.get("content-type", "") and '"server_error"' in resp.text:
        report.fail(f"{what}: SSE stream ended in a server error: {resp.text[-300:]}")


def _http_bodies(mesh: Mesh, examples: int, seed: int | None) -> FuzzReport:
    report = FuzzReport("http_bodies")
    base = _http_base(mesh)
    auth = {"Authorization": f"Bearer {mesh.api_key}"}
    max_body = mesh.config.gateway.max_body_bytes

    deep = st.builds(lambda n, opener: (opener * n).encode(), st.integers(50, 200_000),
                     st.sampled_from(["[", "{\"a\":"]))
    raw = st.one_of(st.binary(max_size=200), deep,
                    st.builds(lambda t: json.dumps(t).encode("utf-8", "surrogatepass"), _json))

    def base_body(route: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": stream}
        if route == "chat":
            body["messages"] = [{"role": "user", "content": "hello"}]
        else:
            body["prompt"] = "hello"
        return body

    prompts = st.one_of(
        st.just(""), st.text(max_size=50), st.just(" " * 20),
        st.builds(lambda n: "word " * n, st.integers(1000, 6000)),   # past the context
        st.just("x" * (max_body + 10)),                              # past max_body_bytes -> 413
        st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=5),  # lone surrogates
    )
    mutated = st.tuples(
        st.sampled_from(["chat", "completion"]), st.booleans(),
        st.dictionaries(st.sampled_from(_FIELDS) | _text, _json, max_size=3),
        st.lists(st.sampled_from(_FIELDS), max_size=2), st.none() | prompts,
    )
    headers = st.fixed_dictionaries({}, optional={
        "X-Priority": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=8),
        "x-request-id": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=140),
        "Authorization": st.sampled_from(["", "Bearer", "Bearer x", "Basic abc", "Bearer " + "k" * 5000]),
    })
    case = st.one_of(st.tuples(st.just("raw"), st.sampled_from(["chat", "completion"]), raw, headers),
                     st.tuples(st.just("json"), mutated, headers))

    with httpx.Client(timeout=60.0) as client:
        @given(case)
        @_settings(examples, seed)
        def run(c: tuple[Any, ...]) -> None:
            report.cases += 1
            kind = c[0]
            hdrs = {**auth, **c[-1]}
            if kind == "raw":
                _, route, data, _ = c
                path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
                _check_http(report, f"POST {path} raw {data[:80]!r} headers {c[-1]}",
                            lambda: client.post(base + path, content=data,
                                                headers={**hdrs, "Content-Type": "application/json"}))
                return
            route, stream, overrides, removed, prompt = c[1]
            body = base_body(route, stream)
            body.update(overrides)
            for name in removed:
                body.pop(name, None)
            if prompt is not None:
                if route == "chat":
                    body["messages"] = [{"role": "user", "content": prompt}]
                else:
                    body["prompt"] = prompt
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            data = json.dumps(body).encode("utf-8", "surrogatepass")
            _check_http(report, f"POST {path} {data[:300]!r} headers {c[-1]}",
                        lambda: client.post(base + path, content=data,
                                            headers={**hdrs, "Content-Type": "application/json"}))

        run()
    return report


def _http_schema(mesh: Mesh, examples: int, seed: int | None) -> FuzzReport:
    """schemathesis: positive and negative cases for every operation in
    the gateway's own /openapi.json."""
    import requests  # schemathesis' transport
    import schemathesis  # only needed here
    from schemathesis.checks import not_a_server_error

    report = FuzzReport("http_schema")
    base = _http_base(mesh)
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    per_op = max(1, examples // (2 * len(operations)))
    auth = {"Authorization": f"Bearer {mesh.api_key}"}
    session = requests.Session()
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @given(operation.as_strategy(generation_mode=mode))
            @_settings(per_op, seed)
            def run(case: schemathesis.Case) -> None:
                report.cases += 1
                try:
                    response = case.call(base_url=base, session=session, headers=auth, timeout=60)
                except requests.RequestException as exc:
                    report.fail(f"{case.method} {case.formatted_path} {case.body!r:.300}: {exc!r}")
                    return
                try:
                    case.validate_response(response, checks=[not_a_server_error])
                except Exception as exc:  # noqa: BLE001 - schemathesis' failure group
                    generation = mode.value  # noqa: B023 - run() is called within this loop iteration
                    report.fail(f"{case.method} {case.formatted_path} ({generation}) body {case.body!r:.300} "
                                f"headers {case.headers}: {response.status_code} {response.text[:200]} {exc}")

            with contextlib.suppress(Unsatisfiable):  # nothing to make negative (GET without parameters)
                run()
    session.close()
    return report


# ---------------------------------------------------------------- gRPC helpers


def _grpc_outcome(report: FuzzReport, what: str, consume: Callable[[], object]) -> None:
    try:
        consume()
    except grpc.RpcError as err:
        code = err.code()
        if code in _SERVER_FAULTS:
            report.fail(f"{what}: {code.name}: {err.details()}")


def _sampling() -> st.SearchStrategy[common_pb2.SamplingParams]:
    def build(d: dict[str, Any]) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(**d)

    return st.fixed_dictionaries({}, optional={
        "temperature": _f32, "top_p": _f32, "top_k": _i32, "min_p": _f32,
        "max_tokens": _u32, "min_tokens": _u32, "stop": st.lists(_ptext, max_size=5),
        "stop_token_ids": st.lists(_u32, max_size=5), "seed": st.integers(-(2**63), 2**63 - 1),
        "presence_penalty": _f32, "frequency_penalty": _f32, "repetition_penalty": _f32,
        "logprobs": _u32, "ignore_eos": st.booleans(),
    }).map(build)


_metadata = st.fixed_dictionaries({}, optional={
    "x-request-id": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=140),
    "x-priority": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=5),
})


def _grpc_inference(mesh: Mesh, examples: int, seed: int | None) -> FuzzReport:
    report = FuzzReport("grpc_inference")
    model = st.one_of(st.just(MODEL), _ptext)
    roles = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]), _ptext)
    chat = st.builds(
        lambda m, msgs, s, p, g: inference_pb2.ChatRequest(
            model=m, messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in msgs], sampling=s,
            priority=p, **({} if g is None else {"max_generation_seconds": g})),
        model, st.lists(st.tuples(roles, st.one_of(_ptext, st.just("word " * 3000))), max_size=3),
        _sampling(), st.one_of(st.integers(0, 3), _i32), st.none() | _f32)
    generate = st.builds(
        lambda m, p, ids, s, pr: inference_pb2.GenerateRequest(
            model=m, prompt=p, prompt_token_ids=ids, sampling=s, priority=pr),
        model, _ptext, st.lists(_u32, max_size=20), _sampling(), st.one_of(st.integers(0, 3), _i32))
    case = st.tuples(st.one_of(chat, generate), _metadata, st.booleans(), st.floats(0.05, 5.0))

    with grpc.insecure_channel(mesh.endpoints.gateway_grpc[0]) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        @given(case)
        @_settings(examples, seed)
        def run(c: tuple[Any, ...]) -> None:
            report.cases += 1
            request, extra, authed, timeout = c
            md = [(k, v) for k, v in extra.items()]
            if authed:
                md.append(("authorization", f"Bearer {mesh.api_key}"))
            method = stub.Chat if isinstance(request, inference_pb2.ChatRequest) else stub.Generate

            def consume() -> None:
                for event in method(request, metadata=md, timeout=timeout):
                    if (event.WhichOneof("event") == "finished"
                            and event.finished.finish_reason == common_pb2.FINISH_REASON_ERROR):
                        report.fail(f"{type(request).__name__} {request} -> finished ERROR: {event.finished.message}")

            _grpc_outcome(report, f"{type(request).__name__} {str(request)[:300]} md={extra}", consume)

        run()
        try:
            stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10)
        except grpc.RpcError as err:
            if err.code() in _SERVER_FAULTS:
                report.fail(f"ListModels without a key: {err}")
    return report


def _stream_then_close(messages: list[Any], hold: threading.Event) -> Iterator[Any]:
    yield from messages
    hold.wait(10.0)  # keep our side open until the call ends (deadline / reader done)


def _drive_bidi(method: Callable[..., Iterator[Any]], messages: list[Any], hold: threading.Event,
                timeout: float) -> None:
    """Send `messages` on a bidi call and read it to its end; the deadline
    is an expected end (the rogue client just stops talking)."""
    try:
        for _ in method(_stream_then_close(messages, hold), timeout=timeout):
            pass
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    finally:
        hold.set()


def _grpc_admit(mesh: Mesh, examples: int, seed: int | None) -> FuzzReport:
    report = FuzzReport("grpc_admit")
    engines = [mesh.config.engine_config(i).engine_id for i in range(mesh.config.engines.count)]
    request = st.builds(
        lambda rid, m, t, p, pt, mt, ph, a, run: scheduler_pb2.AdmitRequest(
            request_id=rid, model=m, tenant=t, priority=p, prompt_tokens=pt, max_tokens=mt,
            prefix_hashes=ph, arrival_unix=a, running_on_engine=run),
        st.one_of(st.just(""), st.just("dup"), _ptext), st.one_of(st.just(MODEL), _ptext), _ptext,
        st.one_of(st.integers(0, 2), _i32), _u32, _u32, st.lists(_u64, max_size=8),
        st.one_of(st.just(0.0), st.just(time.time()), _f64), st.one_of(st.just(""), st.sampled_from(engines), _ptext))
    follow = st.one_of(
        st.builds(lambda: scheduler_pb2.AdmitClientMessage(first_token=scheduler_pb2.FirstToken())),
        st.builds(lambda pt, ct: scheduler_pb2.AdmitClientMessage(done=scheduler_pb2.RequestDone(
            prompt_tokens=pt, completion_tokens=ct)), _u32, _u32),
        st.builds(lambda ex, pt, mt, ph: scheduler_pb2.AdmitClientMessage(replace=scheduler_pb2.Replace(
            exclude_engines=ex, prompt_tokens=pt, max_tokens=mt, prefix_hashes=ph)),
            st.lists(st.one_of(st.sampled_from(engines), _ptext), max_size=3), _u32, _u32,
            st.lists(_u64, max_size=4)),
        request.map(lambda r: scheduler_pb2.AdmitClientMessage(request=r)),
    )
    first = st.one_of(request.map(lambda r: scheduler_pb2.AdmitClientMessage(request=r)), follow)
    case = st.tuples(first, st.lists(follow, max_size=4), st.floats(0.05, 1.0), st.booleans())

    with grpc.insecure_channel(mesh.endpoints.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        @given(case)
        @_settings(examples, seed)
        def run(c: tuple[Any, ...]) -> None:
            report.cases += 1
            head, rest, timeout, half_close = c
            hold = threading.Event()
            if half_close:
                hold.set()

            _grpc_outcome(report, f"Admit {head} then {rest}",
                          lambda: _drive_bidi(stub.Admit, [head, *rest], hold, timeout))

        run()
    return report


def _grpc_connect(mesh: Mesh, examples: int, seed: int | None) -> FuzzReport:
    """A rogue engine. Its ids and models never collide with the real
    engines' (that would be an operator error, not bad input)."""
    report = FuzzReport("grpc_connect")
    real = {mesh.config.engine_config(i).engine_id for i in range(mesh.config.engines.count)}
    hello = st.builds(
        lambda i, a, m, b, tb, mr, w, ml, h, inc: scheduler_pb2.EngineHello(
            engine_id=i, address=a, model=m, block_size=b, total_blocks=tb, max_running=mr, weight=w,
            max_model_len=ml, hash_block_tokens=h, backend="fuzz", incarnation=inc),
        st.one_of(st.just(""), st.just("fuzz-engine"), _ptext.map(lambda s: "fuzz-" + s)),
        st.one_of(st.just("127.0.0.1:1"), _ptext), st.one_of(st.just("fuzz-model"), _ptext.map(lambda s: "z" + s)),
        st.one_of(st.sampled_from([0, 16, 32, 17]), _u32), _u32, _u32, _f32, _u32, st.sampled_from([0, 16, 8]),
        st.one_of(st.just(0), st.sampled_from([1, 2, 3]), _u64))
    message = st.one_of(
        hello.map(lambda h: scheduler_pb2.EngineMessage(hello=h)),
        st.builds(lambda r, wt, bu, bt, cb, s, q, ids: scheduler_pb2.EngineMessage(load=scheduler_pb2.LoadReport(
            running=r, waiting=wt, blocks_used=bu, blocks_total=bt, cached_blocks=cb, serving=s, queued_tokens=q,
            request_ids=ids)), _u32, _u32, _u32, _u32, _u32, st.booleans(), _u64, st.lists(_ptext, max_size=4)),
        st.builds(lambda s, a, r, c: scheduler_pb2.EngineMessage(kv_events=scheduler_pb2.KvEvents(
            seq=s, stored=a, removed=r, cleared=c)), _u64, st.lists(_u64, max_size=6), st.lists(_u64, max_size=6),
            st.booleans()),
        st.builds(lambda s, h: scheduler_pb2.EngineMessage(kv_snapshot=scheduler_pb2.KvSnapshot(seq=s, hashes=h)),
                  _u64, st.lists(_u64, max_size=10)),
        st.just(scheduler_pb2.EngineMessage()),
    )
    case = st.tuples(st.one_of(hello.map(lambda h: scheduler_pb2.EngineMessage(hello=h)), message),
                     st.lists(message, max_size=6), st.floats(0.05, 0.5))

    with grpc.insecure_channel(mesh.endpoints.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        @given(case)
        @_settings(examples, seed)
        def run(c: tuple[Any, ...]) -> None:
            head, rest, timeout = c
            if head.WhichOneof("msg") == "hello" and head.hello.engine_id in real:
                return
            report.cases += 1
            hold = threading.Event()

            _grpc_outcome(report, f"Connect {head} then {rest}",
                          lambda: _drive_bidi(stub.Connect, [head, *rest], hold, timeout))
            # The scheduler must still answer GetState (and list no rogue engine for long).
            _grpc_outcome(report, "GetState after a rogue Connect", lambda: _state(mesh))

        run()
    deadline = time.monotonic() + 10
    while any(e.engine_id not in real for e in _state(mesh).engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    rogue = [e.engine_id for e in _state(mesh).engines if e.engine_id not in real]
    if rogue:
        report.fail(f"rogue engines still registered after their streams ended: {rogue}")
    return report


def _grpc_engine(mesh: Mesh, examples: int, seed: int | None) -> FuzzReport:
    report = FuzzReport("grpc_engine")
    running = threading.Lock()
    ids = st.one_of(st.just(""), st.just("dup"), _ptext)
    request = st.builds(
        lambda rid, p, s, pr, lease, res: engine_pb2.EngineRequest(
            request_id=rid, prompt_token_ids=p, sampling=s, priority=pr, lease_id=lease, resumed_tokens=res),
        ids, st.one_of(st.lists(st.integers(0, 48000), max_size=40), st.lists(_u32, max_size=8),
                       st.integers(1000, 4000).map(lambda n: [7] * n)),
        _sampling(), _i32, _ptext, _u32)
    gen_msg = st.one_of(request.map(lambda r: engine_pb2.EngineGenerateMessage(request=r)),
                        st.just(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration())),
                        st.just(engine_pb2.EngineGenerateMessage()))
    case = st.tuples(st.sampled_from(["generate", "abort", "info"]), gen_msg, st.lists(gen_msg, max_size=3),
                     st.floats(0.05, 3.0), st.booleans(), st.sampled_from(mesh.endpoints.engines), ids)

    channels = {a: grpc.insecure_channel(a) for a in mesh.endpoints.engines}
    try:
        @given(case)
        @_settings(examples, seed)
        def run(c: tuple[Any, ...]) -> None:
            report.cases += 1
            kind, head, rest, timeout, half_close, address, abort_id = c
            stub = engine_pb2_grpc.EngineStub(channels[address])
            if kind == "abort":
                _grpc_outcome(report, f"Abort {abort_id!r}",
                              lambda: stub.Abort(engine_pb2.AbortRequest(request_id=abort_id), timeout=5))
                return
            if kind == "info":
                _grpc_outcome(report, "GetInfo", lambda: stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=5))
                return
            hold = threading.Event()
            if half_close:
                hold.set()

            def consume() -> None:
                try:
                    with running:
                        for event in stub.Generate(_stream_then_close([head, *rest], hold), timeout=timeout):
                            if (event.WhichOneof("event") == "finished"
                                    and event.finished.finish_reason == common_pb2.FINISH_REASON_ERROR):
                                report.fail(f"Generate {head} -> finished ERROR: {event.finished.message}")
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                finally:
                    hold.set()

            _grpc_outcome(report, f"Generate {str(head)[:300]} then {rest}", consume)

        run()
    finally:
        for channel in channels.values():
            channel.close()
    return report


def _grpc_raw(mesh: Mesh, examples: int, seed: int | None) -> FuzzReport:
    """Bytes that are not the method's message (or not protobuf at all),
    to every method of every internal and public service."""
    report = FuzzReport("grpc_raw")
    methods = [
        (mesh.endpoints.gateway_grpc[0], "/kvmesh.v1.Inference/Chat", "unary_stream"),
        (mesh.endpoints.gateway_grpc[0], "/kvmesh.v1.Inference/Generate", "unary_stream"),
        (mesh.endpoints.gateway_grpc[0], "/kvmesh.v1.Inference/ListModels", "unary_unary"),
        (mesh.endpoints.scheduler, "/kvmesh.v1.Scheduler/Admit", "stream_stream"),
        (mesh.endpoints.scheduler, "/kvmesh.v1.Scheduler/AdmitMany", "stream_stream"),
        (mesh.endpoints.scheduler, "/kvmesh.v1.Scheduler/Connect", "stream_stream"),
        (mesh.endpoints.scheduler, "/kvmesh.v1.Scheduler/GetState", "unary_unary"),
        (mesh.endpoints.engines[0], "/kvmesh.v1.Engine/Generate", "stream_stream"),
        (mesh.endpoints.engines[0], "/kvmesh.v1.Engine/Abort", "unary_unary"),
        (mesh.endpoints.engines[0], "/kvmesh.v1.Engine/GetInfo", "unary_unary"),
    ]
    channels = {a: grpc.insecure_channel(a) for a, _, _ in methods}
    try:
        @given(st.sampled_from(methods), st.binary(max_size=64))
        @_settings(examples, seed)
        def run(method: tuple[str, str, str], data: bytes) -> None:
            report.cases += 1
            address, path, kind = method
            channel = channels[address]
            ident = lambda b: b  # noqa: E731 - raw bytes in and out
            call = getattr(channel, kind)(path, request_serializer=ident, response_deserializer=ident)
            md = (("authorization", f"Bearer {mesh.api_key}"),)

            def consume() -> None:
                try:
                    if kind == "unary_unary":
                        call(data, timeout=2, metadata=md)
                    elif kind == "unary_stream":
                        for _ in call(data, timeout=2, metadata=md):
                            pass
                    else:
                        for _ in call(iter([data]), timeout=0.5, metadata=md):
                            pass
                except grpc.RpcError as err:
                    code = err.code()
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        return
                    raise

            _grpc_outcome(report, f"{path} <- {data!r}", consume)

        run()
    finally:
        for channel in channels.values():
            channel.close()
    return report


TARGETS: dict[str, Callable[[Mesh, int, int | None], FuzzReport]] = {
    "http_schema": _http_schema,
    "http_bodies": _http_bodies,
    "grpc_inference": _grpc_inference,
    "grpc_admit": _grpc_admit,
    "grpc_connect": _grpc_connect,
    "grpc_engine": _grpc_engine,
    "grpc_raw": _grpc_raw,
}


def run_target(name: str, mesh: Mesh, examples: int, seed: int | None = None) -> FuzzReport:
    """Run one target, then check every service is still up."""
    if seed is not None:
        random.seed(seed)
    report = TARGETS[name](mesh, examples, seed)
    for problem in alive_problems(mesh):
        report.fail(problem)
    return report
