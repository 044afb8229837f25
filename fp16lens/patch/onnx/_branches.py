"""Sites the scan inlined from If branches (``_core.sites.branch_site``). patch rewrites the
main graph's nodes and initializers only: a problem that starts inside a branch is
refused, naming it; otherwise each If's inlined sites fold back into the If node, one
blocking site, as the graph holds it, and a span from the main graph that runs on into a
branch ends at its If (Silero VAD's encoder into its decoder's LSTM). An If that reads a scaled tensor from its branches (outer scope, not a node
input) becomes an FP32 island whose branches read the tensor unscaled (``_apply.py``, with
``_core.onnx_types.outer_names`` and ``rename_reads``)."""

from __future__ import annotations

import dataclasses

from fp16lens._core import PatchError
from fp16lens._core.sites import Mechanism, branch_owner
from fp16lens.patch._norm_modules import merge_sites, rename_span
from fp16lens.patch.onnx._graph import OnnxModel
from fp16lens.report import Report


def fold_branches(m: OnnxModel, report: Report) -> Report:
    ifs = [s for s, n in m.nodes.items() if n.op_type == "If"]
    owner = {
        s: o for s in report.sites if s not in m.nodes and (o := branch_owner(s, ifs)) is not None
    }
    if not owner:
        return report
    inside = [sp.start for sp in report.spans if sp.start in owner]
    inside += [f.site for f in report.findings if f.mechanism != Mechanism.NOTE and f.site in owner]
    if inside:
        names = ", ".join(dict.fromkeys(inside[:3])) + (" and more" if len(set(inside)) > 3 else "")
        raise PatchError(
            f"the report's problems at {names} lie inside the If {owner[inside[0]]!r}, in the branch "
            "the scan inlined; patch rewrites the main graph's nodes and initializers, not a "
            "branch's: export without patching (fp16lens.export keeps If nodes FP32, so those "
            "values are never stored in FP16), or export the model with that branch's path "
            "fixed (no If) and patch that file"
        )

    def unit_site(unit: str):
        members = [report.sites[s] for s, o in owner.items() if o == unit]
        top = max(members, key=lambda st: st.absmax)
        return dataclasses.replace(top, name=unit, op="If", module=unit)

    sites, edges = merge_sites(report, owner, unit_site)
    spans = [rename_span(sp, owner) for sp in report.spans]  # a span into an If ends in it
    return dataclasses.replace(report, sites=sites, edges=edges, spans=spans)
