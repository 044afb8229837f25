"""Rewriting a module's forward with torch.fx, when a plan is applied: one scalar multiply
on an operand of a functional add/sub/cat, and a module replaced by its rewrite (the
GraphModule of its forward, an island). What the planner reads is in ``_fx_read.py``."""

from __future__ import annotations

import operator

from torch import fx, nn

from fp16lens.patch._fx_read import _is_tensor, op_of, operands, producer_site


def _set_operands(node: fx.Node, new: list, op: str | None) -> None:
    if op == "cat":
        if node.args:
            node.args = (new, *node.args[1:])
        else:
            key = "tensors" if "tensors" in node.kwargs else "input"
            node.kwargs = {**node.kwargs, key: new}
        return
    n_args = min(len(node.args), 2)
    node.args = (*new[:n_args], *node.args[n_args:])
    names = ("input", "other") if node.op == "call_function" else ("self", "other")
    node.kwargs = {**node.kwargs, **dict(zip(names[n_args:], new[n_args:]))}


_SCALED = "fp16lens_scaled"  # fx node meta: a multiply this module inserted


def scale_operands(
    gm: fx.GraphModule,
    node: fx.Node,
    keep: set[str],
    owner: str,
    factor: float,
    cut: set[str] | None = None,
) -> int:
    """Multiply the tensor operands of ``node`` produced by ``cut`` (when fx shows every
    one of them), else every operand whose producer is not in ``keep``, by ``factor``;
    returns how many multiplies were inserted."""
    inserted = 0
    op = op_of(node)
    args = operands(node, op)
    sites = [producer_site(a, owner) for a in args]
    cut = cut or set()
    by_cut = bool(cut) and all(c in sites for c in cut)  # a functional producer shows as None
    new = []
    for arg, site in zip(args, sites):
        scaled = isinstance(arg, fx.Node) and arg.meta.get(_SCALED, False)  # by an earlier Multiply
        hit = site in cut if by_cut else site not in keep
        if _is_tensor(arg) and not scaled and hit:
            with gm.graph.inserting_before(node):
                arg = gm.graph.call_function(operator.mul, (arg, factor))
            arg.meta[_SCALED] = True
            inserted += 1
        new.append(arg)
    _set_operands(node, new, op)
    gm.graph.lint()
    gm.recompile()
    return inserted


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
