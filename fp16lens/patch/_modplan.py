"""Per module: which rule rewrites it, with which input and output scales."""

from __future__ import annotations

from torch import nn

from fp16lens._core.algebra import Kind
from fp16lens.patch._graph import SiteGraph
from fp16lens.patch._plan import Island, Reparam
from fp16lens.patch._rules import bn_affine, bn_affine_stats, fp16_holds, fp16_safe, scale_bn


def module_changes(
    graph: SiteGraph, scales: dict[str, float], affine: set[str], islands: dict[str, str]
) -> tuple[list[Reparam], list[Island]]:
    reparams, out_islands = [], []
    for site, mod in graph.modules.items():
        if (
            site in graph.frozen or site in graph.fp32
        ):  # islands of an earlier patch, or hosts (_reach.py)
            continue
        s_in = graph.scale(graph.input_site(site), scales)
        s_out = graph.scale(site, scales)
        kind = graph.kinds[site]
        if site in islands or (kind == Kind.BLOCK and (s_in != 1 or s_out != 1)):
            why = (
                islands.get(site)
                or f"{getattr(mod, 'op_type', type(mod).__name__)} does not commute with scaling"
            )
            out_islands.append(Island(site, s_in, s_out, why))
        elif kind == Kind.LINEAR and (s_in != 1 or s_out != 1) and site in graph.hosts:
            reparams += _hosted(graph.hosts[site], site, s_in, s_out)
        elif kind == Kind.LINEAR and (s_in != 1 or s_out != 1):
            reparams.append(Reparam(site, "linear", s_in, s_out, _detail(s_in, s_out, "W", "b")))
        elif kind == Kind.BN and (s_in != 1 or s_out != 1 or site in affine):
            reparams.append(_bn(site, mod, s_in, s_out, site in affine))
        elif kind == Kind.NORM and (s_in != 1 or s_out != 1):
            reparams.append(Reparam(site, "norm", s_in, s_out, _norm_detail(s_in, s_out)))
        elif kind == Kind.HOMOG and s_in != s_out:
            raise AssertionError(f"homogeneous {site} between scales {s_in} and {s_out}")
    for join, names in graph.params.items():  # parameters joining a scaled tensor take its scale
        s = graph.scale(join, scales)
        if s != 1 and join not in graph.frozen and join not in graph.fp32:
            reparams += [
                Reparam(n, "parameter", 1.0, s, f"/ {s:g} (joins at {join})") for n in names
            ]
    for owner, why in islands.items():  # modules hosting functional ops no scale passes
        if owner not in graph.modules:
            out_islands.append(Island(owner, 1.0, 1.0, why))
    return reparams, out_islands


def _hosted(names: tuple, site: str, s_in: float, s_out: float) -> list[Reparam]:
    """A functional linear's weight and bias, found by name: each divided in place."""
    weight, bias = names
    out = [
        Reparam(
            weight, "parameter", 1.0, s_out / s_in, f"x {s_in / s_out:g} (the weight of {site})"
        )
    ]
    if bias is not None and s_out != 1:
        out.append(Reparam(bias, "parameter", 1.0, s_out, f"/ {s_out:g} (the bias of {site})"))
    return out


def _detail(s_in: float, s_out: float, w: str, b: str) -> str:
    parts = []
    if s_in / s_out != 1:
        parts.append(f"{w} x {s_in / s_out:g}")
    if s_out != 1:
        parts.append(f"{b} / {s_out:g}")
    return ", ".join(parts)


def _norm_detail(s_in: float, s_out: float) -> str:
    parts = [f"eps / {s_in * s_in:g}"] if s_in != 1 else []
    if s_out != 1:
        parts.append(f"weight, bias / {s_out:g}")
    return ", ".join(parts)


def _bn(site: str, mod: nn.Module, s_in: float, s_out: float, affine: bool) -> Reparam:
    """A batch norm seeing x / s_in that must give BN(x) / s_out. Scaling its statistics is
    exact to the bit but divides eps by s_in^2, and a state_dict holds no eps (a checkpoint
    loaded into the original class would compute with the old one); so where the input is
    scaled, the exact affine form, which keeps eps, comes first when FP16 holds it (and
    the module has the weight and bias it needs: an affine=False batch norm given them would
    hold keys the original class does not load)."""
    if not affine and s_in != 1 and getattr(mod, "weight", None) is not None:
        scale, shift = bn_affine(
            mod.running_mean, mod.running_var, mod.eps, mod.weight, mod.bias, s_in, s_out
        )
        affine = fp16_safe(scale * bn_affine_stats(mod.eps)[1]) and fp16_holds(shift)
    if not affine:
        m, v, _, w, b = scale_bn(
            mod.running_mean, mod.running_var, mod.eps, mod.weight, mod.bias, s_in, s_out
        )
        if fp16_safe(m, v, w, b):
            parts = [f"mean / {s_in:g}, var and eps / {s_in * s_in:g}"] if s_in != 1 else []
            if s_out != 1:
                parts.append(f"weight, bias / {s_out:g}")
            return Reparam(site, "bn-scale", s_in, s_out, ", ".join(parts))
    detail = "exact affine form: weight = gamma/sqrt(var+eps)"
    detail += f" x {s_in / s_out:g}" if s_in != s_out else ""
    detail += ", bias = beta - mean*scale" + (f" / {s_out:g}" if s_out != 1 else "")
    detail += "; mean 0, var 1 - eps (eps kept)"
    return Reparam(site, "bn-affine", s_in, s_out, detail)
