"""`kvmesh plan`'s text: the answer first, then every step of the
arithmetic with the figures put in, so the plan can be checked by hand."""

from __future__ import annotations

import math

from services.planning.fleet_plan import FleetOption, Plan

__all__ = ["render_plan"]


def _ms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "inf"
    return f"{seconds * 1e6:,.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def _s(seconds: float) -> str:
    return "inf" if not math.isfinite(seconds) else f"{seconds:,.3f} s"


def _header(plan: Plan) -> list[str]:
    p, w, t = plan.profile, plan.workload, plan.targets
    classes = ", ".join(f"{c.name} {100 * c.share:.0f}% (TTFT p{100 * t.quantile:g} <= {c.ttft_seconds:g} s"
                        f"{', preempts' if c.preempts else ''})" for c in t.classes)
    return [
        f"engine profile: {p.name}",
        f"  step = {_ms(p.fixed_seconds)} + c x ({_ms(p.per_sequence_seconds)} + {_ms(p.per_kilotoken_seconds)}"
        f" x context/1k) + {_ms(p.per_prefill_token_seconds)} x prefill tokens; batch cap "
        f"{p.max_running}, chunk {p.chunk_tokens} tokens, KV {p.kv_tokens:,} tokens",
        f"load: {w.rate:g} req/s, prompt {w.prompt_tokens:.0f} tokens ({100 * w.cached_fraction:.0f}% cached "
        f"for the {100 * w.hit_rate:.0f}% that hit: {w.prefill_tokens:.0f} prefilled on average), output "
        f"{w.output_tokens:g} tokens (CV {t.service_cv:g}); {classes}"
        + (f"; TPOT <= {_ms(t.tpot_seconds)}" if t.tpot_seconds > 0 else ""),
    ]


def _option(plan: Plan, o: FleetOption, title: str) -> list[str]:
    p, w = plan.profile, plan.workload
    ld = o.load
    a = p.per_sequence_seconds + p.per_kilotoken_seconds * w.mean_context / 1000.0
    q = ld.rate * w.output_tokens / (1.0 - ld.prefill_share) if ld.prefill_share < 1 else math.inf
    lines = [
        f"{title}: {o.engines} engine(s), {ld.rate:.3f} req/s each",
        f"  prefill share  rho_p = {ld.rate:.3f} x {w.prefill_tokens:g} x {_ms(p.per_prefill_token_seconds)}"
        f" = {ld.prefill_share:.3f}",
        f"  per sequence   a = {_ms(p.per_sequence_seconds)} + {_ms(p.per_kilotoken_seconds)} x "
        f"{w.mean_context:g}/1000 = {_ms(a)}",
        f"  Little's law   q = {ld.rate:.3f} x {w.output_tokens:g} / (1 - {ld.prefill_share:.3f}) = {q:.3f};"
        f"  batch c = q x {_ms(p.fixed_seconds)} / (1 - q x a) = {ld.batch:.2f} (cap {p.max_running})",
        f"  step (TPOT)    s = ({_ms(p.fixed_seconds)} + c x a) / (1 - rho_p) = {_ms(ld.step_seconds)}",
        f"  service        prefill {_s(ld.prefill_seconds)} + {w.output_tokens:g} x s = {_s(ld.service_seconds)};"
        f" KV held {ld.kv_tokens:,.0f} tokens",
        f"  queue          k = {o.engines} x {p.max_running} = {o.slots} slots, A = {w.rate:g} x "
        f"{_s(ld.service_seconds)} = {o.offered:.1f} Erlangs, P(wait) = ErlangC(k, A) = {o.p_wait:.2e}",
    ]
    q = plan.targets.quantile
    lines.append(f"  first token    unqueued at p{100 * q:g}: a step {_ms(ld.step_seconds)} + prefill of "
                 f"{w.prefill_tokens_at(q):.0f} tokens {_s(ld.prefill_seconds_for(w.prefill_tokens_at(q)))};"
                 f" waits: Cobham's priority split of Erlang C x (1 + CV^2)/2 = "
                 f"{(1 + plan.targets.service_cv ** 2) / 2:g}")
    for c in o.classes:
        mark = "met" if c.met else "MISSED"
        lines.append(f"  {c.name:<6} wait p{100 * plan.targets.quantile:g} {_s(c.wait_seconds)} -> TTFT "
                     f"{_s(c.ttft_seconds)} (target {c.target_seconds:g} s): {mark}")
    if not ld.stable:
        lines.append("  unstable: the batch passes its cap or the KV, or the engine cannot keep up")
    if plan.targets.tpot_seconds > 0:
        lines.append(f"  TPOT {_ms(ld.step_seconds)} (target {_ms(plan.targets.tpot_seconds)}): "
                     f"{'met' if o.tpot_met else 'MISSED'}")
    return lines


def render_plan(plan: Plan) -> str:
    out = _header(plan)
    if plan.chosen is None:
        out.append("no fleet of up to 4,096 engines meets these targets (a class's TTFT target is below "
                   "its prefill time, or TPOT below the fixed step)")
        return "\n".join(out) + "\n"
    c = plan.chosen
    out += ["", f"ANSWER: {c.engines} engine(s) serving + {plan.spares} warm spare(s); batch "
                f"{c.load.batch:.1f} of {plan.profile.max_running} per engine; queue wait p"
                f"{100 * plan.targets.quantile:g} " + ", ".join(f"{x.name} {_s(x.wait_seconds)}" for x in c.classes),
            ""]
    out += _option(plan, c, "chosen")
    if plan.below is not None:
        out += [""] + _option(plan, plan.below, "one fewer")
    if plan.burst is not None:
        out += ["", f"spares: a burst of x{plan.targets.burst:g} ({plan.workload.rate * plan.targets.burst:g} "
                    f"req/s) needs {plan.burst.engines} engine(s); at least {plan.targets.min_spares} for an "
                    f"engine's loss: {plan.spares} kept warm, so either is served while a cold engine starts"]
    return "\n".join(out) + "\n"
