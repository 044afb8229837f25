"""The last resort of patch's proof: a span kept FP32 end to end.

``PatchOptions.fp32_spans`` names spans of the report (by index) that real FP16 still
breaks after the planner's fix; ``fp32_modules`` names modules to keep FP32 whole. Both
are applied to the plan after ``build_plan`` returns (``widen``) and to the model after
``apply_plan`` (``apply_widened``): every module that runs one of the span's sites (a
leaf module site, or the module whose forward runs a functional site) becomes an
``Fp32Span`` island. Islands whose values are still beyond FP16 (no end of the span in
them, or the span reaches the model output) hand their output onward in FP32; the
islands holding an end of the span, where values are back in range, hand it back in the
model's dtype. The planner's own rewrite inside stays: it is exact in FP32 too.
"""

from __future__ import annotations

import torch
from torch import nn

from fp16lens._core import FP16_MAX
from fp16lens.patch._fx_rewrite import replace_module
from fp16lens.patch._island import Fp32Island, _leave
from fp16lens.patch._plan import Plan, SpanFp32
from fp16lens.report import Report


class Fp32Span(Fp32Island):
    """An FP32 island of a span kept FP32 end to end: like ``Fp32Island`` (scales 1), and
    with ``fp32_out`` its float outputs stay FP32 (the consumers are islands too, or the
    model output)."""

    fp32_out = False

    def __init__(self, module: nn.Module, fp32_out: bool = False):
        super().__init__(module, 1.0, 1.0)
        self.fp32_out = bool(fp32_out)

    def forward(self, *args, **kwargs):
        # the inputs may come FP32 from the span's island before: the output goes back in
        # the dtype the model was cast to (``outside_dtype``), or stays FP32
        args = tuple(self._enter(a, 1.0) for a in args)
        kwargs = {k: self._enter(v, 1.0) for k, v in kwargs.items()}
        return _leave(
            self.module(*args, **kwargs), torch.float32 if self.fp32_out else self.outside_dtype, []
        )

    def extra_repr(self) -> str:
        return f"fp32_out={self.fp32_out}"


def host(report: Report, site: str) -> str:
    """The module that runs ``site``: a module site itself, a functional op's owner."""
    st = report.sites.get(site)
    if st is None:
        return site.partition(":")[0] if ":" in site else site
    return st.name if st.kind == "module" else st.module


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def outermost(names) -> list[str]:
    """``names`` without those inside another one of them (order kept)."""
    names = list(dict.fromkeys(names))
    return [n for n in names if not any(o != n and _inside(n, o) for o in names)]


def span_hosts(
    report: Report, index: int, model: nn.Module | None = None
) -> tuple[list[str], list[str]]:
    """The modules running span ``index``'s sites (outermost only) and those of them that
    hand FP32 onward: no end of the span inside them, or the span reaches the output;
    also a module handing back whose recorded output is beyond FP16."""
    span = report.spans[index]
    names = set(dict(model.named_modules())) if model is not None else None
    hosts = [host(report, s) for s in span.sites]
    hosts = outermost(h if names is None or h in names else "" for h in hosts)
    ends = [host(report, e) for e in span.ends]
    out = []
    for h in hosts:
        holds_end = any(_inside(e, h) for e in ends)
        st = report.sites.get(h)
        beyond = st is not None and st.kind == "module" and st.absmax > FP16_MAX
        wanted = not holds_end or beyond or (span.reaches_output and _last(report, span, h))
        if wanted and _fed_within(report, h, hosts):
            out.append(h)
    return hosts, out


def _fed_within(report: Report, h: str, hosts: list[str]) -> bool:
    """Whether everything that reads module ``h``'s values outside it runs inside one of
    ``hosts`` (or is the model output): only then may ``h`` hand FP32 onward (an FP16
    module given FP32 fails under ``.half()``)."""
    for s in report.sites:
        if not _inside(host(report, s), h):
            continue
        for c in report.consumers(s):
            ch = host(report, c)
            if not _inside(ch, h) and not any(_inside(ch, o) for o in hosts):
                return False
    return True


def _last(report: Report, span, h: str) -> bool:
    """Whether module ``h`` runs the span's last site (the model output, for a span
    reaching it)."""
    return bool(span.sites) and _inside(host(report, span.sites[-1]), h)


def enclosing(report: Report, index: int) -> str:
    """The innermost module holding every site of span ``index`` ("" = the model)."""
    hosts = [host(report, s) for s in report.spans[index].sites]
    parts = [h.split(".") if h else [] for h in hosts]
    common: list[str] = []
    for segs in zip(*parts) if parts else ():
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    return ".".join(common)


def widen(plan: Plan, model: nn.Module, report: Report, spans, modules) -> Plan:
    """``plan`` with ``spans`` (indices) kept FP32 end to end and ``modules`` kept FP32
    whole, as ``SpanFp32`` entries (applied by ``apply_widened``)."""
    names = set(dict(model.named_modules()))
    before = plan.fp32_modules
    for i in dict.fromkeys(spans):
        if not 0 <= i < len(report.spans):
            continue
        hosts, out = span_hosts(report, i, model)
        s = report.spans[i]
        plan.widened.append(
            SpanFp32(
                i,
                tuple(hosts),
                tuple(out),
                f"span {s.start} -> {s.end or 'output'} kept FP32 end to end (the fix alone did not hold it in FP16)",
            )
        )
    for m in dict.fromkeys(modules):
        if m not in names:
            continue
        reaches = m == "" and any(s.reaches_output for s in report.spans)
        plan.widened.append(
            SpanFp32(-1, (m,), (m,) if reaches else (), f"{m or 'the model'} kept FP32 whole")
        )
    outer = [m for w in plan.widened for m in w.modules]
    covered = [u for u in plan.unresolved if any(_inside(host(report, u.site), o) for o in outer)]
    for u in covered:  # what the planner could not fix runs in FP32 now
        plan.notes.append(f"{u.site}: kept FP32 (was: {u.reason})")
    plan.unresolved = [u for u in plan.unresolved if u not in covered]
    plan.fp16_flops = max(0.0, plan.fp16_flops - _flops_inside(model, report, outer, before))
    return plan


def _flops_inside(model: nn.Module, report: Report, outer: list[str], before: list[str]) -> float:
    """Conv/linear FLOPs of the watched forwards (as ``_flops.conv_linear_flops`` counts
    them) run by modules inside ``outer`` and not already inside an island (``before``)."""
    named = dict(model.named_modules())
    total = 0.0
    for site, st in report.sites.items():
        mod = named.get(site) if st.kind == "module" else None
        if not isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)):
            continue
        if not any(_inside(site, o) for o in outer) or any(_inside(site, b) for b in before):
            continue
        outputs = (
            getattr(mod, "out_channels", None)
            or getattr(mod, "out_features", None)
            or mod.weight.shape[0]
        )
        total += 2.0 * st.numel * mod.weight.numel() / max(int(outputs), 1)
    return total


def apply_widened(model: nn.Module, plan: Plan) -> nn.Module:
    """Wrap the plan's ``widened`` modules in ``Fp32Span`` (outermost only); returns the
    model, or the island wrapping it when the whole model is kept FP32."""
    modules = outermost(m for w in plan.widened for m in w.modules)
    fp32_out = {m for w in plan.widened for m in w.fp32_out}
    for name in sorted(modules, key=lambda n: -n.count(".")):
        if name == "":
            return Fp32Span(model, "" in fp32_out)
        replace_module(model, name, Fp32Span(model.get_submodule(name), name in fp32_out))
    return model
