"""Reading a module's forward with torch.fx, for planning: the traced forward of the
module that runs an op, its nodes and operands, and the parameters a functional op reads.
Nothing here changes a model (the rewrites are in ``_fx_rewrite.py``).

Only the module whose forward runs the op is traced (all its submodules stay leaves, so
qualified names and state_dict keys do not change). A module that already is a
GraphModule (symbolic_trace, onnx2torch, torch.export) is read as it is: its nodes are
those watch named its functional ops after (``:add_1``).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from fp16lens._core import PatchError
from fp16lens._core.sites import parse_site, site_name

_OPS = {
    "add": {
        operator.add,
        operator.iadd,
        torch.add,
        "add",
        "add_",
        "__add__",
        "__iadd__",
        "__radd__",
    },
    "sub": {operator.sub, operator.isub, torch.sub, "sub", "sub_", "__sub__", "__isub__"},
    "cat": {torch.cat, torch.concat, torch.concatenate},
    "mul": {
        operator.mul,
        operator.imul,
        torch.mul,
        "mul",
        "mul_",
        "__mul__",
        "__imul__",
        "__rmul__",
    },
}
_ATEN = {
    "add": "add",
    "add_": "add",
    "sub": "sub",
    "sub_": "sub",
    "cat": "cat",
    "concat": "cat",
    "mul": "mul",
    "mul_": "mul",
}
_PASS = {"view", "reshape", "flatten", "contiguous", "permute", "transpose", "clone"}
_SHAPES = {"shape", "ndim", "dtype", "device", "size", "dim", "numel"}  # non-tensor results
_RETRACED = "_fp16lens_retraced"  # a GraphModule this module traced (its node names are fx's)


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True  # only the owner's own forward is traced


@contextlib.contextmanager
def _state_kept(mod: nn.Module) -> Iterator[None]:
    """``mod``'s own attributes as they were, after a trace ran its forward with fx's
    proxies: a forward that caches (``self.cache[key] = ...``, ``self.last = ...``, as
    anchor generators and rotary tables do) would otherwise keep proxies in the user's
    model. Attributes set or added are put back or removed, and the dicts, lists and sets
    it held get their contents back in place (their identity kept)."""
    before = dict(mod.__dict__)
    contents = {k: _contents(v) for k, v in before.items()}
    try:
        yield
    finally:
        for key in [k for k in mod.__dict__ if k not in before]:
            del mod.__dict__[key]
        for key, value in before.items():
            mod.__dict__[key] = value
            if contents[key] is not None:
                _restore(value, contents[key])


def _contents(value):
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, set)):
        return type(value)(value)
    return None


def _restore(value, kept) -> None:
    if isinstance(value, list):
        value[:] = kept
    else:  # a dict or a set
        value.clear()
        value.update(kept)


def trace_owner(model: nn.Module, owner: str) -> fx.GraphModule:
    """The owner module as a GraphModule (itself when it is one); PatchError naming the
    cause when it does not trace."""
    mod = model.get_submodule(owner) if owner else model
    if isinstance(mod, fx.GraphModule):
        return mod
    try:
        with _state_kept(mod):  # the GraphModule takes what the traced forward made
            graph = _LeafTracer().trace(mod, concrete_args=_none_defaults(mod))
            gm = fx.GraphModule(mod, graph, class_name=type(mod).__name__)
    except Exception as exc:
        raise PatchError(
            f"module {owner or '(the model)'!r} does not trace with torch.fx ({type(exc).__name__}: "
            f"{exc}); keep its ops in FP32 instead: export(..., fp32_modules=[...])"
        ) from None
    setattr(gm, _RETRACED, True)
    return gm


def _none_defaults(mod: nn.Module) -> dict[str, None] | None:
    """Arguments of the forward that default to None, traced as None: a proxy for them
    would take every ``if x is not None`` branch (fx then asserts they stay None)."""
    params = inspect.signature(mod.forward).parameters.values()
    found = {
        p.name: None for p in params if p.default is None and p.kind is p.POSITIONAL_OR_KEYWORD
    }
    return found or None


def op_of(node: fx.Node) -> str | None:
    """ "add", "sub", "cat" or "mul" for a node running one of them on tensors, else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    target = node.target
    packet = getattr(target, "overloadpacket", None)  # aten ops (torch.export graphs)
    if packet is not None:
        return _ATEN.get(packet.__name__)
    op = next((k for k, targets in _OPS.items() if target in targets), None)
    args = operands(node, op) if op else []
    if op == "sub" and not (args and _is_tensor(args[0])):
        return None  # number - tensor runs aten rsub, which watch names "rsub"
    return op if any(_is_tensor(a) for a in args) else None  # shape arithmetic is not an op


def operands(node: fx.Node, op: str | None = None) -> list:
    """The operands of an add/sub (two) or the tensors of a cat, from args or kwargs."""
    if (op or op_of(node)) == "cat":
        found = (
            node.args[0] if node.args else node.kwargs.get("tensors", node.kwargs.get("input", ()))
        )
        return list(found) if isinstance(found, (list, tuple)) else []  # *args: not seen
    names = ("input", "other") if node.op == "call_function" else ("self", "other")
    args = list(node.args[:2])
    return args + [node.kwargs[k] for k in names[len(args) :] if k in node.kwargs]


def _is_tensor(arg) -> bool:
    """Whether an fx argument is a tensor (not a number, None, or a value computed from
    shapes), from the traced value when the graph keeps it (torch.export), else by origin."""
    if not isinstance(arg, fx.Node):
        return False
    if "val" in arg.meta:
        return isinstance(arg.meta["val"], torch.Tensor)
    if arg.op == "call_function" and arg.target is getattr:
        return arg.args[1] not in _SHAPES
    if arg.op == "call_method" and arg.target in _SHAPES:
        return False
    if arg.op == "call_function" and arg.target is operator.getitem:
        return _is_tensor(arg.args[0])
    if arg.op == "call_function" and getattr(arg.target, "__module__", None) == "_operator":
        return any(_is_tensor(a) for a in arg.args)
    return True


def find_op(gm: fx.GraphModule, site: str) -> fx.Node:
    """The fx node of a functional site: by its node name in a GraphModule watch named
    (``:add_1``), else ``owner:add#n``, the n-th add the owner's forward runs on tensors."""
    name = parse_site(site)
    if not getattr(gm, _RETRACED, False):
        node = next((nd for nd in gm.graph.nodes if nd.name == name.op), None)
        if node is not None and op_of(node) is not None:
            return node
    nodes = [nd for nd in gm.graph.nodes if op_of(nd) == name.op]
    if not 0 < name.nth <= len(nodes):
        raise PatchError(
            f"cannot find {site} in the traced forward; it runs {len(nodes)} {name.op} op(s) on tensors"
        )
    return nodes[name.nth - 1]


def producer_site(node, owner: str) -> str | None:
    """The site producing ``node`` (through reshapes): a module, or in a GraphModule watch
    named, a functional op; None for the owner's inputs and for numbers."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _PASS:
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        return f"{owner}.{node.target}" if owner else str(node.target)
    if node.op in ("call_function", "call_method") and not getattr(
        node.graph.owning_module, _RETRACED, False
    ):
        return site_name(owner, node.name)
    return None


_PARAM_OPS = frozenset(
    {
        "conv1d",
        "conv2d",
        "conv3d",
        "convolution",
        "linear",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    }
)


@dataclass
class FunctionalParams:
    """The weight and bias of a functional conv/linear in a GraphModule (torch.export
    keeps a model's convs so): rewritten in place like a Conv2d module's."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def functional_params(model: nn.Module, site: str) -> FunctionalParams | None:
    """The parameters of functional site ``owner:node`` when its owner is a GraphModule
    and the node is a conv/linear whose weight (and bias) no other node reads."""
    name = parse_site(site)
    mod = model.get_submodule(name.module) if name.is_op else None
    if not isinstance(mod, fx.GraphModule):
        return None
    node = next((n for n in mod.graph.nodes if n.name == name.op), None)
    if node is None or node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", node.target)
    if getattr(packet, "__name__", None) not in _PARAM_OPS:
        return None
    found = [_arg(node, i, key) for i, key in ((1, "weight"), (2, "bias"))]
    if found[0] is None or not all(f is None or _private_attr(f) for f in found):
        return None
    weight, bias = (None if f is None else _attr(mod, f.target) for f in found)
    return FunctionalParams(weight, bias) if isinstance(weight, torch.Tensor) else None


def _arg(node: fx.Node, index: int, key: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(key)


def _private_attr(arg) -> bool:
    """A parameter read by one get_attr node used once (rescaling it changes no other op)."""
    if not (isinstance(arg, fx.Node) and arg.op == "get_attr" and len(arg.users) == 1):
        return False
    return sum(n.op == "get_attr" and n.target == arg.target for n in arg.graph.nodes) == 1


def _attr(mod: nn.Module, target: str):
    for part in target.split("."):
        mod = getattr(mod, part, None)
    return mod


# ---- parameters that join a tensor (a class token concatenated, a position embedding added)
_PARAM_VIEWS = frozenset({
    "expand", "expand_as", "view", "reshape", "repeat", "unsqueeze", "squeeze", "permute",
    "transpose", "contiguous", "flatten", "type_as", "to",
})  # fmt: skip
"""Ops between a parameter and a join that scale with it: (p/s).expand(...) = p.expand(...)/s."""


class _ReadTracer(_LeafTracer):
    """A tracer for reading a forward, never for running it: a branch on a traced value
    (``if height != self.image_size[0]: raise``) takes its false side. The caller checks
    that the graph runs as many joins as the report saw."""

    def to_bool(self, obj) -> bool:
        return False


def _analysis_trace(mod: nn.Module) -> fx.Graph | None:
    """The module's own forward as an fx graph, arguments defaulting to None or to a bool
    taken as those values (only read, never run: the module is not replaced)."""
    params = inspect.signature(mod.forward).parameters.values()
    concrete = {
        p.name: p.default
        for p in params
        if p.kind is p.POSITIONAL_OR_KEYWORD and (p.default is None or isinstance(p.default, bool))
    }
    try:
        with _state_kept(mod):
            graph = _ReadTracer().trace(mod, concrete_args=concrete or None)
    except Exception:  # a forward fx cannot follow: its joins stay opaque
        return None
    for node in list(graph.nodes):
        _inline(graph, node)
    return graph


def _inline(graph: fx.Graph, node: fx.Node) -> None:
    """Replace a call of a plain Python function that fx kept whole (``torch.fx.wrap``, as
    torchvision's patch-merging pad) by its traced body, so its joins are seen."""
    fn = node.target
    if node.op != "call_function" or not inspect.isfunction(fn) or node.kwargs:
        return
    if fn.__module__.split(".")[0] in ("torch", "operator", "builtins", "math"):
        return
    try:
        body = _ReadTracer().trace(fn)
    except Exception:  # its body stays one opaque call
        return
    holders = [n for n in body.nodes if n.op == "placeholder"]
    if len(holders) != len(node.args):
        return
    with graph.inserting_before(node):
        out = graph.graph_copy(body, dict(zip(holders, node.args)))
    if isinstance(out, fx.Node):
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _root(arg):
    """The node ``arg`` reads through views, expands and slices (what scales with it)."""
    while isinstance(arg, fx.Node) and arg.op in ("call_method", "call_function"):
        name = arg.target if arg.op == "call_method" else getattr(arg.target, "__name__", "")
        if name not in _PARAM_VIEWS and arg.target is not operator.getitem:
            return arg
        arg = arg.args[0]
    return arg


def _param_of(root, mod: nn.Module) -> str | None:
    """The name (relative to ``mod``) of the floating parameter a get_attr ``root`` reads,
    when that read is its only one in ``mod``'s forward and the parameter is ``mod``'s own
    (or in its ParameterList/ParameterDict)."""
    if not (isinstance(root, fx.Node) and root.op == "get_attr"):
        return None
    t = _attr(mod, root.target)
    reads = sum(n.op == "get_attr" and n.target == root.target for n in root.graph.nodes)
    ok = (
        isinstance(t, nn.Parameter)
        and t.is_floating_point()
        and reads == 1
        and len(root.users) == 1
    )
    holder = _attr(mod, root.target.rpartition(".")[0]) if "." in root.target else mod
    if not isinstance(holder, (nn.ParameterList, nn.ParameterDict)) and holder is not mod:
        return None  # a submodule's parameter: its own forward may read it too
    return str(root.target) if ok else None


def _site_node(
    model: nn.Module, site: str, seen: int, graphs: dict
) -> tuple[nn.Module, fx.Node | None]:
    """The module owning functional ``site`` and the site's fx node in its traced forward,
    when that forward runs as many such ops as the ``seen`` ones the report saw in it."""
    name = parse_site(site)
    mod = model.get_submodule(name.module) if name.module else model
    if isinstance(mod, fx.GraphModule):  # its nodes are named as watch named the sites
        try:
            return mod, find_op(mod, site)
        except PatchError:
            return mod, None
    if name.module not in graphs:
        graphs[name.module] = _analysis_trace(mod)
    nodes = (
        [nd for nd in graphs[name.module].nodes if op_of(nd) == name.op]
        if graphs[name.module]
        else []
    )
    if len(nodes) != seen or not 0 < name.nth <= len(nodes):
        return mod, None
    return mod, nodes[name.nth - 1]


def constant_factor(model: nn.Module, site: str, seen: int, graphs: dict) -> bool:
    """Whether product ``site`` (fed by one tensor in the report) multiplies that tensor by
    a constant: a number, or a parameter or buffer read through views (ConvNeXt's layer
    scale ``x.mul(self.gamma.reshape(1, -1, 1, 1))``): homogeneous of degree 1. False for
    ``x * x`` (degree 2), a tensor computed in forward, or a forward fx cannot follow."""
    _, node = _site_node(model, site, seen, graphs)
    if node is None:
        return False
    roots = [_root(a) for a in operands(node)]
    tensors = [r for r in roots if isinstance(r, fx.Node) and r.op != "get_attr"]
    constants = [
        r
        for r in roots
        if (isinstance(r, (int, float)) and not isinstance(r, bool))
        or (isinstance(r, fx.Node) and r.op == "get_attr")
    ]
    return len(roots) == 2 and len(tensors) == 1 and len(constants) == 1


def parameter_operands(
    model: nn.Module, site: str, tensors: int, seen: int, graphs: dict
) -> tuple[str, ...] | None:
    """For a join site fed by ``tensors`` tensor producers (a report's edges), the qualified
    names of the parameters that are its other operands (``x + self.pos_embedding``,
    ``cat([self.cls_token.expand(n, -1, -1), x])``): scaled by 1/p they carry the join's
    scale; an empty tuple where every operand reads one tensor (``cat([x[0::2], x[1::2]])``,
    ``x + x``). None when an operand is something else (a constant, a buffer), a parameter
    is read elsewhere in the forward, the owner does not trace, or its traced forward runs
    another number of such joins than the ``seen`` ones the report saw in it. ``graphs``
    caches traces."""
    mod, node = _site_node(model, site, seen, graphs)
    if node is None:
        return None
    roots = [_root(a) for a in operands(node)]
    params = [p for p in (_param_of(r, mod) for r in roots) if p is not None]
    attrs = [r for r in roots if isinstance(r, fx.Node) and r.op == "get_attr"]
    if len(attrs) != len(params) or not all(isinstance(r, fx.Node) for r in roots):
        return None  # a buffer, a parameter read elsewhere too, or a number
    if len({r for r in roots if r.op != "get_attr"}) != tensors:
        return None  # operands from more tensors than the report's producers
    owner = parse_site(site).module
    prefix = f"{owner}." if owner else ""
    every = [t for _, t in model.named_parameters(remove_duplicate=False)]
    if any(sum(t is mod.get_parameter(p) for t in every) != 1 for p in params):
        return None  # tied to another module's parameter: scaling it would change that one
    return tuple(prefix + p for p in params)
