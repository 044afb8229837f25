"""One scalar multiply on an operand of a functional add/sub/cat, by torch.fx.

Only the module whose forward runs the op is traced (all its submodules stay leaves, so
qualified names and state_dict keys do not change) and replaced by the GraphModule.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from fp16lens._core import PatchError

_OPS = {
    "add": {operator.add, operator.iadd, torch.add, "add", "add_", "__add__", "__iadd__"},
    "sub": {operator.sub, operator.isub, torch.sub, "sub", "sub_", "__sub__", "__isub__"},
    "cat": {torch.cat, torch.concat},
}
_PASS = {"view", "reshape", "flatten", "contiguous", "permute", "transpose", "clone"}


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True  # only the owner's own forward is traced


def trace_owner(model: nn.Module, owner: str) -> fx.GraphModule:
    """The owner module as a GraphModule; PatchError naming the cause when it does not trace."""
    mod = model.get_submodule(owner) if owner else model
    try:
        graph = _LeafTracer().trace(mod)
    except Exception as exc:
        raise PatchError(
            f"module {owner or '(the model)'!r} does not trace with torch.fx ({type(exc).__name__}: "
            f"{exc}); keep its ops in FP32 instead: export(..., fp32_modules=[...])"
        ) from None
    return fx.GraphModule(mod, graph, class_name=type(mod).__name__)


def find_op(gm: fx.GraphModule, site: str) -> fx.Node:
    """The fx node of a functional site ``owner:add#n`` (n-th add in the owner's forward)."""
    op, _, n = site.rpartition(":")[2].partition("#")
    index = int(n) if n else 1
    nodes = [
        nd
        for nd in gm.graph.nodes
        if nd.op in ("call_function", "call_method") and nd.target in _OPS.get(op, ())
    ]
    if len(nodes) < index:
        raise PatchError(
            f"cannot find {site} in the traced forward; it runs {len(nodes)} {op} op(s)"
        )
    return nodes[index - 1]


def producer_site(node: fx.Node, owner: str) -> str | None:
    """The module site producing ``node`` (through reshapes), None for the owner's inputs."""
    while node.op == "call_method" and node.target in _PASS:
        node = node.args[0]
    if node.op == "call_module":
        return f"{owner}.{node.target}" if owner else str(node.target)
    return None


_SCALED = "fp16lens_scaled"  # fx node meta: a multiply this module inserted


def scale_operands(
    gm: fx.GraphModule, node: fx.Node, keep: set[str], owner: str, factor: float,
    cut: set[str] | None = None,
) -> int:
    """Multiply the tensor operands of ``node`` produced by ``cut`` (when fx shows every
    one of them), else every operand whose producer is not in ``keep``, by ``factor``;
    returns how many multiplies were inserted."""
    inserted = 0
    operands = node.args[0] if node.target in _OPS["cat"] else node.args[:2]
    sites = [producer_site(a, owner) if isinstance(a, fx.Node) else None for a in operands]
    by_cut = bool(cut) and all(c in sites for c in cut)  # a functional producer shows as None
    new = []
    for arg, site in zip(operands, sites):
        scaled = isinstance(arg, fx.Node) and arg.meta.get(_SCALED, False)  # by an earlier Multiply
        hit = site in cut if by_cut else site not in keep
        if isinstance(arg, fx.Node) and not scaled and hit:
            with gm.graph.inserting_before(node):
                arg = gm.graph.call_function(operator.mul, (arg, factor))
            arg.meta[_SCALED] = True
            inserted += 1
        new.append(arg)
    if node.target in _OPS["cat"]:
        node.args = (new, *node.args[1:])
    else:
        node.args = (*new, *node.args[2:])
    gm.graph.lint()
    gm.recompile()
    return inserted


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
