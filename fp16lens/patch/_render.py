"""Rendering a Plan with rich (kept apart from the data)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def render(plan):
    if not plan.changes and not plan.unresolved:
        yield Text("nothing to patch: every value fits FP16")
        for n in plan.notes:  # what was written all the same (an FP16 file's FP32 twin)
            yield Text(f"note: {n}", style="yellow")
        return
    if plan.regions:
        t = Table(title="rescaling regions (exact: powers of two)", title_justify="left")
        for col in ("factor", "peak", "entries (x 1/p)", "exits (x p)", "fixes"):
            t.add_column(col, overflow="fold")
        for r in plan.regions:
            t.add_row(
                f"{r.factor:g}",
                f"{r.peak:.3g} -> {r.peak / r.factor:.3g}",
                "\n".join(r.entries),
                "\n".join(r.exits),
                "\n".join(r.reasons),
            )
        yield t
    if plan.reparametrized:
        t = Table(title="re-parametrized modules", title_justify="left")
        for col in ("module", "rule", "detail"):
            t.add_column(col)
        for r in plan.reparametrized:
            t.add_row(r.module, r.rule, r.detail)
        yield t
    if plan.multiplies:
        t = Table(title="scalar multiplies on join operands (torch.fx)", title_justify="left")
        for col in ("join", "operands from", "x"):
            t.add_column(col, overflow="fold")
        for m in plan.multiplies:
            t.add_row(m.site, "\n".join(m.cut), f"{m.factor:g}")
        yield t
    if plan.underflow_rules:
        t = Table(
            title="underflow fixed exactly (the block scaled up by 2^j)", title_justify="left"
        )
        for col in ("singular op", "rule", "j", "how"):
            t.add_column(col, overflow="fold")
        for u in plan.underflow_rules:
            t.add_row(u.site, u.rule, str(u.exponent), u.detail)
        yield t
    if plan.islands:
        t = Table(title="FP32 islands (no rescaling passes them)", title_justify="left")
        for col in ("module", "in x", "out /", "why"):
            t.add_column(col)
        for i in plan.islands:
            t.add_row(i.module, f"{i.in_scale:g}", f"{i.out_scale:g}", i.reason)
        yield t
    if plan.widened:
        t = Table(
            title="spans kept FP32 end to end (real FP16 failed without it)", title_justify="left"
        )
        for col in ("span", "FP32 modules", "hand FP32 onward", "why"):
            t.add_column(col, overflow="fold")
        for w in plan.widened:
            t.add_row(
                str(w.span) if w.span >= 0 else "-",
                "\n".join(m or "(the model)" for m in w.modules),
                "\n".join(m or "(the model)" for m in w.fp32_out),
                w.reason,
            )
        yield t
    if plan.changes:
        yield Text(
            f"{len(plan.fp32_modules)} FP32 island(s); FP16 FLOP share (conv/linear FLOPs left "
            f"in FP16 / all): {plan.fp16_flop_share:.2%}"
        )
    if plan.proof:
        worst = min(plan.proof, key=lambda b: (b.finite, b.cosine))
        verdict = "proven" if plan.proven else "NOT proven"
        yield Text(
            f"real FP16 on {len(plan.proof)} batch(es): {verdict}; worst batch {worst.batch}: "
            f"{'finite' if worst.finite else 'NON-FINITE at ' + (worst.first_nonfinite or '?')}, "
            f"cosine {worst.cosine:.6f}, max rel {worst.max_rel:.3g}; FP32 outputs rel "
            f"{max(b.fp32_rel for b in plan.proof):.2g}",
            style="green" if plan.proven else "red",
        )
    for u in plan.unresolved:
        yield Text(f"not fixed: {u.site}: {u.reason}", style="red")
    for n in plan.notes:
        yield Text(f"note: {n}", style="yellow")
