"""The exact fix for underflow that breaks, where the algebra allows it
(``_core/algebra/_underflow.py``): the region from the value FP16 flushes to the singular op
is scaled UP by 2^j, folded into the linear layer that produces it (or one exact multiply),
and ended by the singular op itself: a log's additive j w log 2 is absorbed by the next
bias or one subtraction, a ratio cancels it, a power carries it to the next Linear/Conv or
one multiply. Found on the torch.fx graph of the module whose forward runs the block (the
same module the FP32 island would be); j from the report's statistics of each op, mapped
to the fx nodes by op name and order. Where anything does not fit, ``plan_rule`` returns
why, and the planner keeps the FP32 island.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import fx, nn

from fp16lens._core import PatchError
from fp16lens._core.algebra import _underflow as alg
from fp16lens._core.sites import site_module
from fp16lens._core.underflow import SINGULAR_ARG, SINGULAR_BOTH, is_singular_name
from fp16lens.patch._fx_read import _is_tensor, trace_owner
from fp16lens.patch._plan import UnderflowRule
from fp16lens.report import Report


class NoRule(Exception):
    """The block does not fit an exact rule; the message says why."""


@dataclass
class Analysis:
    """The scaled region on the owner's fx graph, per unit j (powers w: the value is
    2^(j w) times its FP32 self)."""

    source: fx.Node
    singular: fx.Node
    power: dict[fx.Node, Fraction] = field(default_factory=dict)  # every scaled value (w != 0)
    consts: list[tuple[fx.Node, int | str, float, Fraction]] = field(
        default_factory=list
    )  # numbers
    # joined to a scaled value (node, argument, value, power): scaled with it
    guards: dict[fx.Node, tuple[float, Fraction]] = field(default_factory=dict)  # a positive eps
    # added or a lower clamp bound: keeps its output at or above the value (scaled)
    logs: list[tuple[fx.Node, str, Fraction]] = field(default_factory=list)  # (log node, op, w in)
    absorbed: list[tuple[fx.Node, Fraction]] = field(default_factory=list)  # Linear/Conv fed at w
    out: list[tuple[int, Fraction]] = field(default_factory=list)  # output slot -> its w
    ended: set[fx.Node] = field(default_factory=set)  # ops whose scaled inputs give w = 0

    def powers(self) -> list[Fraction]:
        """Every scaled value's power: 2^(j w) must stay a power of two for each."""
        return list(self.power.values())


def _name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return alg.op_name(node.target)
    if node.op == "call_function":
        t = node.target
        packet = getattr(t, "overloadpacket", None)
        n = getattr(packet or t, "__name__", None)
        return alg.op_name(n) if n else None
    return None


def _args(node: fx.Node) -> list:
    """The positional operands, with ``input``/``other``/``exponent`` given as keywords
    appended in that order (a clamp's bounds are read by name)."""
    args = list(node.args)
    for k in ("input", "other", "exponent"):
        if k in node.kwargs and len(args) < 2:
            args.append(node.kwargs[k])
    return args


def _is_linear(mod) -> bool:
    """A Linear or a (not transposed) convolution: its weight absorbs a scale of its input."""
    return isinstance(mod, nn.Linear) or (
        isinstance(mod, nn.modules.conv._ConvNd) and not mod.transposed
    )


def _pads(mod) -> bool:
    """A conv whose zero padding meets a shifted input (a log's constant): no bias absorbs it."""
    if not isinstance(mod, nn.modules.conv._ConvNd):
        return False
    pad = mod.padding
    return pad == "same" if isinstance(pad, str) else any(p != 0 for p in pad)


def analyse(gm: fx.GraphModule, singular: fx.Node) -> Analysis:
    """The region from the one value the singular operand derives from to where every scale
    has ended; NoRule where an op outside the table reads a scaled value."""
    source = _source(gm, singular)
    an = Analysis(source, singular, {source: Fraction(1)})
    for node in gm.graph.nodes:
        if node is source or node.op == "placeholder":
            continue
        if node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            for i, o in enumerate(outs):
                if isinstance(o, fx.Node) and an.power.get(o, 0) != 0:
                    an.out.append((i, an.power[o]))
            continue
        ins = [a for a in node.all_input_nodes if an.power.get(a, 0) != 0]
        if not ins:
            continue
        if not _is_tensor(node) and node.op != "call_module":  # x.shape, x.size(): no scale
            continue
        w = _step(gm, node, an)
        if w != 0:
            an.power[node] = w
        else:
            an.ended.add(node)
    return an


def _source(gm: fx.GraphModule, singular: fx.Node) -> fx.Node:
    """The one value the singular operand is computed from through the table's ops."""
    op = _name(singular) or ""  # a singular node was found by its name
    args = _args(singular)
    starts = args[:2] if op in alg.RATIO or op == "atan2" else [args[SINGULAR_ARG.get(op, 0)]]
    leaves, seen = set(), set()
    todo = [a for a in starts if isinstance(a, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or (
            n.op == "call_module" and _is_linear(gm.get_submodule(n.target))
        ):
            leaves.add(n)
            continue
        if (
            n.op == "get_attr"
        ):  # a parameter or buffer: at power 0 (a join with it is refused later)
            continue
        name = _name(n)
        known = (
            name in alg.SAME
            or name in alg.POWERS
            or name in alg.JOINS
            or name in alg.GUARDS
            or name in alg.PRODUCTS
            or name in ("mul", "div", "pow")
        )
        if not known:
            raise NoRule(
                f"{n.name} ({name or n.op}) feeds the singular operand and carries no power-of-two scale"
            )
        todo += [a for a in n.all_input_nodes if _is_tensor(a)]
    if len(leaves) != 1:
        raise NoRule(f"the singular operand is computed from {len(leaves)} values, not one")
    return leaves.pop()


def _calls(gm: fx.GraphModule, target: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == target)


def _number(a):
    return a if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _step(gm: fx.GraphModule, node: fx.Node, an: Analysis) -> Fraction:
    """The power of ``node``'s value from its operands' (recording the guards, logs and
    absorbing modules met); NoRule for an op outside the table."""
    pw = an.power
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if _is_linear(mod) and len(node.args) == 1 and _calls(gm, node.target) == 1:
            an.absorbed.append((node, pw[node.args[0]]))
            return Fraction(0)
        if isinstance(mod, (nn.ReLU, nn.Identity, nn.Flatten, nn.Dropout)):
            return pw[node.args[0]]
        raise NoRule(f"module {node.target} ({type(mod).__name__}) reads a scaled value")
    name = _name(node)
    args = _args(node)
    w0 = pw.get(args[0], Fraction(0)) if args and isinstance(args[0], fx.Node) else Fraction(0)
    if name in alg.LOG_BASE:
        an.logs.append((node, name, w0))
        return Fraction(0)
    if name in alg.POWERS:
        return w0 * alg.POWERS[name]
    if name == "pow":
        e = alg.exponent_of(args[1]) if len(args) > 1 else None
        if e is None or not isinstance(args[0], fx.Node):
            raise NoRule(
                f"{node.name}: pow by a tensor or an exponent that is not a small fraction"
            )
        return w0 * e
    if name in ("clamp", "clamp_min", "clamp_max"):
        for key, at in (("min", 1), ("max", 2)):
            if name == "clamp_max" and key == "min":
                continue
            pos = 1 if name != "clamp" else at
            has = (
                node.kwargs.get(key)
                if key in node.kwargs
                else (node.args[pos] if len(node.args) > pos else None)
            )
            if has is None:
                continue
            if _number(has) is None:
                raise NoRule(f"{node.name}: a clamp bound that is a tensor")
            an.consts.append((node, key if key in node.kwargs else pos, float(has), w0))
            if key == "min" and float(has) > 0:
                an.guards[node] = (float(has), w0)
        return w0
    if name in alg.SAME:
        others = [a for a in node.all_input_nodes[1:] if _is_tensor(a) and pw.get(a, 0) != 0]
        if others:
            raise NoRule(f"{node.name} ({name}) takes a scaled value as a second argument")
        return w0
    if name == "mul" or name == "div" or name in alg.PRODUCTS:
        a, b = args[0], args[1] if len(args) > 1 else None
        wa = pw.get(a, Fraction(0)) if isinstance(a, fx.Node) else Fraction(0)
        wb = pw.get(b, Fraction(0)) if isinstance(b, fx.Node) else Fraction(0)
        if any(isinstance(v, fx.Node) and not _is_tensor(v) for v in (a, b)):
            raise NoRule(f"{node.name}: a scaled value times a number computed at run time")
        return wa - wb if name == "div" else wa + wb
    if name == "atan2":
        wa, wb = (
            pw.get(a, Fraction(0)) if isinstance(a, fx.Node) else Fraction(0) for a in args[:2]
        )
        if wa != wb:
            raise NoRule(f"{node.name}: atan2 of operands at different scales")
        return Fraction(0)
    if name in alg.JOINS:
        ops = list(args[0]) if name in ("cat", "stack") else args[:2]
        ws, numbers = set(), []
        for i, a in enumerate(ops):
            if isinstance(a, fx.Node) and _is_tensor(a):
                ws.add(pw.get(a, Fraction(0)))
            elif _number(a) is not None and name not in ("cat", "stack"):
                numbers.append((i, float(a)))
            elif a is not None:
                raise NoRule(f"{node.name}: {name} of a scaled value and {a!r}")
        if len(ws) != 1 or (name in ("add", "sub") and node.kwargs.get("alpha", 1) != 1):
            raise NoRule(f"{node.name}: {name} of operands at different scales")
        w = ws.pop()
        for i, v in numbers:  # scaled with the values: 2^s y + 2^s c = 2^s (y + c)
            an.consts.append((node, i, v, w))
            if name == "add" and v > 0:
                an.guards[node] = (v, w)
        return w
    raise NoRule(
        f"{node.name} ({name or node.op}) reads a scaled value and carries no power-of-two scale"
    )


# ---- choosing j from the report --------------------------------------------------------
def _site_map(gm: fx.GraphModule, report: Report, owner: str) -> dict[fx.Node, str]:
    """fx node -> the report's site of that op: the owner's functional ops (views and shape
    arithmetic are no sites) in order, one to one with the report's sites of the owner in
    the order they first ran. Where they do not line up (a function fx does not enter,
    ``F.normalize``, runs several ops watch sees): NoRule."""
    nodes, names = [], []
    for node in gm.graph.nodes:
        name = _name(node)
        if name is None or name in alg.VIEWS or not _is_tensor(node):
            continue
        if any(_is_tensor(a) for a in node.all_input_nodes):
            nodes.append(node)
            names.append(alg.family(name))
    ops = sorted(
        (
            n
            for n, st in report.sites.items()
            if st.kind != "module" and st.module == owner and alg.op_name(st.op) not in alg.VIEWS
        ),
        key=lambda n: report.sites[n].order,
    )
    seen = [alg.family(alg.op_name(report.sites[n].op)) for n in ops]
    if seen != names:
        raise NoRule(
            f"the traced forward of {owner or 'the model'} runs {', '.join(names) or 'no ops'}, "
            f"the report {', '.join(seen) or 'none'}: they do not line up"
        )
    return dict(zip(nodes, ops))


def _low(report: Report, site: str) -> float:
    """The lower edge of the lowest binade holding a non-zero value (0: below 2^-26)."""
    return report.sites[site].quantile_low(1e-12)


def choose(
    gm: fx.GraphModule, an: Analysis, report: Report, owner: str, source_site: str | None
) -> int:
    """j: as large as the scaled peaks allow (so the flushed values rise most), lowered until
    every value that must not be 0 lands at or above 2^-20; NoRule where none fits."""
    sites = _site_map(gm, report, owner)
    stats = dict(sites)
    if source_site:
        stats[an.source] = source_site
    demands = []
    for node, w in an.power.items():
        site = stats.get(node)
        if site is None:
            if _name(node) in alg.VIEWS:
                continue
            raise NoRule(f"{node.name}: no statistics in the report for a scaled op")
        demands.append((report.sites[site].absmax, w))
    demands += [
        (abs(c), w) for _n, _k, c, w in an.consts if c != 0
    ]  # a scaled constant is stored too
    step = alg.step_of(an.powers())
    lo, hi = alg.exponent_range(demands)
    j = hi - hi % step
    while j >= max(lo, step):
        if _lifts(an, stats, report, j):
            return j
        j -= step
    raise NoRule(
        f"no 2^j keeps the scaled values under 2^{alg.PEAK_EXP} and lifts the flushed ones "
        f"above 2^{alg.LIFT_EXP} (j in [{lo}, {hi}])"
    )


def _lifts(an: Analysis, stats: dict, report: Report, j: int) -> bool:
    """Whether at 2^j the singular operand(s) and the reductions and negative powers before
    them are lifted (a guard that survives, scaled, ends the walk back)."""
    guards = an.guards
    op = _name(an.singular) or ""  # a singular node was found by its name
    args = _args(an.singular)
    starts = args[:2] if op == "atan2" else [args[SINGULAR_ARG.get(op, 0)]]
    todo, seen = [a for a in starts if isinstance(a, fx.Node)], set()
    operands = set(todo)  # every value that must not be 0, and what they are views of
    while todo:
        n = todo.pop()
        if n in seen or n not in an.power:
            continue
        seen.add(n)
        w = an.power[n]
        if n in guards and alg.lifted(guards[n][0], guards[n][1], j):
            continue  # the scaled eps keeps it off 0
        name = _name(n)
        check = n in operands or name in alg.REDUCTIONS or w < 0
        if check and n in stats and not alg.lifted(_low(report, stats[n]), w, j):
            return False
        if check and n not in stats and name not in alg.VIEWS and n is not an.source:
            return False
        ins = [a for a in n.all_input_nodes if a in an.power]
        if name in alg.VIEWS and n in operands:
            operands.update(ins)
        todo += ins
    return True


def plan_rule(
    model: nn.Module, report: Report, finding, owner: str, taken: set[str]
) -> UnderflowRule:
    """The exact rule for one underflow finding in module ``owner`` (``taken``: modules
    other fixes rewrite); NoRule (its message: why not) where none applies."""
    try:
        gm = trace_owner(model, owner)
    except PatchError as exc:
        cause = str(exc).split(" (", 1)[1].split(")", 1)[0] if " (" in str(exc) else str(exc)
        raise NoRule(f"its forward does not trace with torch.fx ({cause})") from None
    sites = _site_map(gm, report, owner)
    node = next((n for n, s in sites.items() if s == finding.site), None)
    if node is None or not is_singular_name(_name(node) or ""):
        raise NoRule(f"{finding.site} not found in the traced forward of {owner}")
    an = analyse(gm, node)
    inner = {_qual(owner, n.target) for n, _ in an.absorbed} | {
        _qual(owner, u.target) for n, _, _ in an.logs for u in n.users if u.op == "call_module"
    }
    if inner & taken:
        raise NoRule(f"{', '.join(sorted(inner & taken))} rewritten by another fix")
    folded, held = _fold(gm, an, report, owner, sites, taken)
    j = choose(gm, an, report, owner, held)
    scaled_ops = sum(1 for a in _args(node)[:2] if isinstance(a, fx.Node) and a in an.power)
    rule = alg.rule_name(_name(node) or "", scaled_ops)  # node: the singular op, named
    where = (
        f"{folded} weights x 2^{j}"
        if folded
        else (
            f"{_qual(owner, an.source.target)} weights x 2^{j}"
            if an.source.op == "call_module"
            else f"one multiply x 2^{j} at the block's input {an.source.name}"
        )
    )
    if rule == alg.RULE_LOG:
        ends = "; ".join(
            f"{n.name} + {alg.log_offset(op, w * j):.6g} taken back by {log_absorber(gm, n)}"
            for n, op, w in an.logs
            if w != 0
        )
    elif rule == alg.RULE_RATIO:
        ends = f"2^{j} cancels in {node.name}"
    else:
        undo = [
            *(
                n.name
                for n in an.ended
                if n.op != "call_module" and n not in {m for m, _, _ in an.logs}
            ),
            *(f"the weight of {n.target}" for n, _ in an.absorbed),
            *(["one multiply at the output"] if an.out else []),
        ]
        ends = f"the power carried by {node.name} undone by {', '.join(undo)}"
    what = "wrong" if _name(node) in SINGULAR_BOTH else "non-finite"
    detail = f"{rule}: {finding.site} ({finding.count} {what} in FP16): {where}; {ends}"
    return UnderflowRule(
        finding.site, owner, node.name, rule, j, folded or "", detail, an.source.name
    )


def _fold(
    gm, an: Analysis, report: Report, owner: str, sites, taken: set[str]
) -> tuple[str | None, str | None]:
    """(the Linear/Conv outside ``owner`` producing the source, whose weight and bias take
    2^j when the block alone reads it and nothing else rewrites it, or None: the source is
    a layer inside the owner, rewritten with it, or gets one exact multiply; the site whose
    values the source holds)."""
    src = an.source
    if src.op == "call_module":
        name = _qual(owner, src.target)
        if name in taken or _calls(gm, src.target) != 1:
            raise NoRule(f"{name} is rewritten by another fix or called twice")
        return None, name
    readers, todo = [], list(src.users)
    while todo:  # the sites reading the source, through views (which are no sites)
        u = todo.pop()
        if u in sites:
            readers.append(sites[u])
        elif _name(u) in alg.VIEWS:
            todo += list(u.users)
    prods = {p for r in readers for p in report.producers(r) if not _inside(p, owner)}
    if len(prods) != 1:
        raise NoRule(
            f"the block's input {src.name} has {len(prods)} producers in the report, not one"
        )
    p = prods.pop()
    st = report.sites.get(p)
    consumers = [c for q, c in report.edges if q == p]
    if (
        st is not None
        and st.kind == "module"
        and st.op in ("Linear", "Conv1d", "Conv2d", "Conv3d")
        and p not in taken
        and all(_inside(c, owner) for c in consumers)
    ):
        return p, p
    if st is not None and st.underflow:
        raise NoRule(
            f"{p} hands the block values FP16 already flushes, and no linear layer takes 2^j"
        )
    return None, p


def _qual(owner: str, target) -> str:
    """The qualified name of the owner's child ``target``."""
    return f"{owner}.{target}" if owner else str(target)


def _inside(site: str, owner: str) -> bool:
    mod = site_module(site) if ":" in site else site
    return not owner or mod == owner or mod.startswith(owner + ".")


# ---- applying ------------------------------------------------------------------------------
def apply_rule(model: nn.Module, rule: UnderflowRule) -> nn.Module:
    """Rewrite the owner's forward for ``rule`` (the folded layer's Reparam is applied
    before); returns the GraphModule to put in its place (the model itself for owner "")."""
    gm = trace_owner(model, rule.owner)
    node = next((n for n in gm.graph.nodes if n.name == rule.node), None)
    if node is None:
        raise PatchError(
            f"cannot find {rule.site} ({rule.node}) in the traced forward of {rule.owner}"
        )
    rewrite(gm, analyse(gm, node), rule.exponent, bool(rule.folded))
    return gm


def rewrite(gm: fx.GraphModule, an: Analysis, j: int, fold_source: bool) -> None:
    """Edit ``gm`` in place: the source x 2^j (unless a folded layer makes it so), guards
    x 2^(j w), a log's constant absorbed, Linear/Conv weights fed at 2^(j w) x 2^(-j w),
    outputs at 2^(j w) multiplied back. Exact in FP32 up to the log's constant's rounding."""
    g = gm.graph
    src = an.source
    if not fold_source:
        if src.op == "call_module" and _is_linear(gm.get_submodule(src.target)):
            _scale_module(gm.get_submodule(src.target), 2.0**j, bias=True)
        else:
            with g.inserting_after(src):
                m = g.call_function(operator.mul, (src, 2.0**j))
            src.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
    for node, key, value, w in an.consts:
        new = value * 2.0 ** float(j * w)
        if isinstance(key, str):
            node.kwargs = {**node.kwargs, key: new}
        else:
            args = list(node.args)
            if key < len(args):
                args[key] = new
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, ("other" if key == 1 else "min"): new}
    for node, op, w in an.logs:
        if w != 0:
            _absorb_log(gm, node, alg.log_offset(op, w * j))
    for node, w in an.absorbed:
        _scale_module(gm.get_submodule(node.target), 2.0 ** -float(j * w), bias=False)
    if an.out:
        out = next(n for n in g.nodes if n.op == "output")
        outs = out.args[0]
        single = not isinstance(outs, (tuple, list))
        vals = [outs] if single else list(outs)
        for i, w in an.out:
            with g.inserting_before(out):
                vals[i] = g.call_function(operator.mul, (vals[i], 2.0 ** -float(j * w)))
        out.args = (vals[0] if single else type(outs)(vals),)
    g.lint()
    gm.recompile()


@torch.no_grad()
def _scale_module(mod: nn.Module, factor: float, bias: bool) -> None:
    mod.weight.copy_((mod.weight.double() * factor).to(mod.weight.dtype))
    if bias and mod.bias is not None:
        mod.bias.copy_((mod.bias.double() * factor).to(mod.bias.dtype))


def _absorb_log(gm: fx.GraphModule, node: fx.Node, offset: float) -> None:
    """log(2^s y) = log y + offset: the one reader absorbs -offset (an add of a number, a
    Linear's bias without padding), else one subtraction right after the log."""
    users = list(node.users)
    if len(users) == 1:
        u = users[0]
        name = _name(u)
        args = _args(u)
        if (
            name in ("add", "sub")
            and len(args) > 1
            and args[0] is node
            and _number(args[1]) is not None
            and "alpha" not in u.kwargs
            and len(u.args) > 1
        ):
            u.args = (
                u.args[0],
                args[1] - offset if name == "add" else args[1] + offset,
                *u.args[2:],
            )
            return
        if u.op == "call_module":
            mod = gm.get_submodule(u.target)
            uses = sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == u.target)
            if _is_linear(mod) and mod.bias is not None and not _pads(mod) and uses == 1:
                with torch.no_grad():
                    dims = tuple(range(1, mod.weight.dim()))
                    shift = mod.weight.double().sum(dim=dims) * offset
                    mod.bias.copy_((mod.bias.double() - shift).to(mod.bias.dtype))
                return
    with gm.graph.inserting_after(node):
        sub = gm.graph.call_function(operator.sub, (node, offset))
    node.replace_all_uses_with(sub, delete_user_cb=lambda u: u is not sub)


def log_absorber(gm: fx.GraphModule, node: fx.Node) -> str:
    """Where a log's constant goes, in words (for the plan)."""
    users = list(node.users)
    if len(users) == 1:
        u = users[0]
        if _name(u) in ("add", "sub") and len(u.args) > 1 and _number(u.args[1]) is not None:
            return f"the constant of {u.name}"
        if (
            u.op == "call_module"
            and _is_linear(gm.get_submodule(u.target))
            and gm.get_submodule(u.target).bias is not None
            and not _pads(gm.get_submodule(u.target))
        ):
            return f"the bias of {u.target}"
    return "one subtraction after it"
