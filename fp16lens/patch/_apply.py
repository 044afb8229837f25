"""Applying a plan to a model: parameters rewritten in place, islands swapped in."""

from __future__ import annotations

import torch
from torch import nn

from fp16lens._core.algebra import eps_name
from fp16lens._core.sites import site_module
from fp16lens.patch._actisland import insert_island
from fp16lens.patch._fx_read import find_op, functional_params, trace_owner
from fp16lens.patch._fx_rewrite import replace_module, scale_operands
from fp16lens.patch._fxisland import insert_group
from fp16lens.patch._island import Fp32Island
from fp16lens.patch._plan import Plan, Reparam
from fp16lens.patch._rules import (
    bn_affine,
    bn_affine_stats,
    scale_bn,
    scale_input_weight,
    scale_linear,
    scale_norm_eps,
)
from fp16lens.patch._underflow_rules import apply_rule


@torch.no_grad()
def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Rewrite ``model``; returns it, or a GraphModule replacing it when a multiply goes
    into the model's own forward."""
    named = dict(model.named_modules())
    for r in plan.reparametrized:
        if r.rule == "parameter":
            _parameter(model.get_parameter(r.module), r)
            continue
        mod = named.get(r.module)
        _RULES[r.rule](mod if mod is not None else functional_params(model, r.module), r)
    for island in (i for i in plan.islands if not i.site and not i.nodes):  # functional ones: below
        inner = model.get_submodule(island.module)
        replace_module(
            model,
            island.module,
            Fp32Island(inner, island.in_scale, island.out_scale, island.fp32_out, island.fp32_in),
        )
    for owner in dict.fromkeys(
        r.owner for r in plan.underflow_rules
    ):  # owners no other fix rewrites
        # (the planner checks); the rules of one owner share their scaled region: applied once
        rule = next(r for r in plan.underflow_rules if r.owner == owner)
        gm = apply_rule(model, rule)
        if owner:
            replace_module(model, owner, gm)
        elif gm is not model:  # the model's own forward: the GraphModule is the model now
            _keep_members(model, gm)
            model = gm
    owners = dict.fromkeys(
        [
            *(m.owner for m in plan.multiplies),
            *(site_module(i.site) for i in plan.islands if i.site),
            *("" for i in plan.islands if i.nodes),
        ]
    )
    for owner in owners:
        gm = trace_owner(model, owner)
        for m in (m for m in plan.multiplies if m.owner == owner):
            scale_operands(gm, find_op(gm, m.site), set(m.keep), owner, m.factor, set(m.cut))
        for island in (i for i in plan.islands if i.site and site_module(i.site) == owner):
            insert_island(gm, island)
        for island in (
            i for i in plan.islands if i.nodes and not owner
        ):  # ops of the model's forward
            insert_group(gm, island.module, island.nodes, island)
        original = model.get_submodule(owner) if owner else model
        if gm is original:  # a GraphModule: edited in place
            continue
        _keep_members(original, gm)
        if not owner:
            return gm
        replace_module(model, owner, gm)
    return model


def _keep_members(original: nn.Module, gm: nn.Module) -> None:
    """fx keeps only what the forward uses; keep every child, parameter and buffer so
    qualified names and state_dict keys stay those of the original."""
    for name, child in original.named_children():
        if not hasattr(gm, name):
            gm.add_module(name, child)
    for name, p in original.named_parameters(recurse=False):
        if not hasattr(gm, name):
            gm.register_parameter(name, p)
    for name, b in original.named_buffers(recurse=False):
        if not hasattr(gm, name):
            gm.register_buffer(name, b, persistent=name not in original._non_persistent_buffers_set)
    gm.train(original.training)


def _set(param: torch.Tensor | None, value: torch.Tensor | None) -> None:
    if param is not None and value is not None:
        param.copy_(value)


def _linear(mod: nn.Module, r: Reparam) -> None:
    bias = getattr(mod, "bias", None)  # an embedding has none
    w, b = scale_linear(mod.weight, bias, r.s_in, r.s_out)
    _set(mod.weight, w)
    _set(bias, b)


def _parameter(param: torch.Tensor, r: Reparam) -> None:
    """A parameter that joins a scaled tensor (a class token, a position embedding)."""
    param.copy_(param.double().div(r.s_out).to(param.dtype))


def _bn_scale(mod: nn.Module, r: Reparam) -> None:
    m, v, eps, w, b = scale_bn(
        mod.running_mean, mod.running_var, mod.eps, mod.weight, mod.bias, r.s_in, r.s_out
    )
    _set(mod.running_mean, m)
    _set(mod.running_var, v)
    _set(mod.weight, w)
    _set(mod.bias, b)
    mod.eps = eps


def _bn_affine(mod: nn.Module, r: Reparam) -> None:
    """The exact affine form, with the module's own eps kept (``bn_affine_stats``): a
    state_dict holds no eps, so the patched weights loaded into the original class compute
    the same."""
    scale, shift = bn_affine(
        mod.running_mean, mod.running_var, mod.eps, mod.weight, mod.bias, r.s_in, r.s_out
    )
    var, c = bn_affine_stats(mod.eps)
    scale = scale * c  # a power of two: exact
    if mod.weight is None:  # affine=False: give it the parameters the affine form needs
        mod.weight = nn.Parameter(scale.clone(), requires_grad=False)
        mod.bias = nn.Parameter(shift.clone(), requires_grad=False)
        mod.affine = True
    _set(mod.weight, scale)
    _set(mod.bias, shift)
    mod.running_mean.zero_()
    mod.running_var.fill_(var)


def _norm(mod: nn.Module, r: Reparam) -> None:
    if r.s_in != 1:
        name = eps_name(mod) or "eps"  # HF's RMS norms: variance_epsilon
        eps = (
            getattr(mod, name) if getattr(mod, name) is not None else torch.finfo(torch.float32).eps
        )
        setattr(mod, name, scale_norm_eps(eps, r.s_in))
    if r.s_out != 1:
        _set(mod.weight, mod.weight.double().div(r.s_out).to(mod.weight.dtype))
        bias = getattr(mod, "bias", None)
        _set(bias, None if bias is None else bias.double().div(r.s_out).to(bias.dtype))


def _input(mod: nn.Module, r: Reparam) -> None:
    """A first layer that takes an input the caller divides by ``r.s_in``."""
    for name in input_weights(mod):
        w = getattr(mod, name)
        w.copy_(scale_input_weight(w, r.s_in))


def input_weights(mod: nn.Module) -> list[str]:
    """The weights that multiply a module's input: a conv/linear's ``weight``, an RNN's
    ``weight_ih_l0`` (both directions); none for other modules."""
    if isinstance(mod, nn.RNNBase):
        return [n for n in ("weight_ih_l0", "weight_ih_l0_reverse") if hasattr(mod, n)]
    if isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd)):
        return ["weight"]
    return []


_RULES = {
    "linear": _linear,
    "bn-scale": _bn_scale,
    "bn-affine": _bn_affine,
    "norm": _norm,
    "input": _input,
}
