"""The fix of an underflow finding (mechanism ``underflow``, kind ``flush-singular``) in an
ONNX graph: the nodes from the producer whose outputs flush through the singular node
(``Square``, the ``Add`` of its eps, ``Log``; a ``Sqrt`` before a ``Div``, and the
``Div``) become one FP32 island. In FP32 the producer's tiny values and the eps survive,
so the singular node sees what the FP32 graph sees; what it hands back (a log, a ratio)
is in FP16's normal range. The islands are named in ``metadata_props`` like every other
island, so ``fp16lens.export(..., precision="fp16")`` keeps their Casts."""

from __future__ import annotations

from fp16lens._core.sites import Mechanism
from fp16lens._core.underflow import ONNX_GUARDS, ONNX_SINGULAR_ARG, ONNX_ZERO_KEEPING
from fp16lens.patch._plan import Island
from fp16lens.patch.onnx._graph import OnnxModel

# the singular input of each singular op, the guards and the zero-keeping nodes: the
# tables watch/onnx/_underflow.py judges by (one home, _core/underflow.py)
_SLOT = ONNX_SINGULAR_ARG
_GUARDS = ONNX_GUARDS
_PASS = ONNX_ZERO_KEEPING
_STEPS = 8  # nodes walked back from the singular node to the producer


def _members(m: OnnxModel, site: str) -> list[str]:
    """Sites from the producer to the singular node ``site``, in graph order: the chain of
    the singular input back through guards (an Add/Sub of a constant, Max/Min/Clip bounds)
    and value-keeping nodes (Sqrt, Abs, moves) to the first other node, the producer."""
    names = {id(n): s for s, n in m.nodes.items()}
    node = m.nodes[site]
    chain = [site]
    t = node.input[_SLOT.get(node.op_type, 0)]
    for _ in range(_STEPS):
        up = m.producer.get(t)
        if up is None or id(up) not in names or up.op_type == "Constant":
            break
        chain.append(names[id(up)])
        live = [i for i in up.input if i and i not in m.consts]
        if up.op_type in _PASS:
            t = up.input[0]
        elif up.op_type in _GUARDS and len(live) == 1:
            t = live[0]
        else:
            break
    return chain[::-1]


def underflow_islands(m: OnnxModel, report, taken: set[str]) -> list[Island]:
    """One FP32 island per node of each underflow finding's chain (``taken``: sites
    already islands)."""
    out = []
    for f in report.findings:
        if f.mechanism != Mechanism.UNDERFLOW or f.site not in m.nodes:
            continue
        chain = _members(m, f.site)
        why = (
            f"underflow: the {len(chain)} nodes from {chain[0]} to {m.nodes[f.site].op_type} "
            f"{f.site} run in FP32, so the values FP16 flushes to 0 and the eps it loses "
            "never reach it"
        )
        for s in chain:
            if s not in taken:
                taken.add(s)
                out.append(Island(module=s, in_scale=1.0, out_scale=1.0, reason=why))
                why = f"underflow: with {chain[0]} (above)"
    return out
