"""ONNX tensor -> report site, read from node metadata (no dependency on fp16lens.export).

fp16lens.export stamps ``fp16lens.module`` / ``fp16lens.op`` on every node; the dynamo
exporter's own ``pkg.torch.onnx.name_scopes`` (module scopes, then the FX node) is read
when the stamp is missing. A torch.nn leaf module's node is named after the module
(a batch norm folded into its conv names the batch norm, whose output the conv now
computes); a functional op is ``module:op``.
"""

from __future__ import annotations

import ast

from torch import nn

from fp16lens._core.sites import site_name
from fp16lens._trace import is_builtin_leaf

_MODULE, _OP = "fp16lens.module", "fp16lens.op"
_SCOPES = "pkg.torch.onnx.name_scopes"


def node_module(node, names: set[str]) -> tuple[str | None, str]:
    """(module qualified name or None, aten op name or "") of one node."""
    meta = {p.key: p.value for p in node.metadata_props}
    if _MODULE in meta:
        return meta[_MODULE], meta.get(_OP, "")
    if _SCOPES in meta:
        scopes = ast.literal_eval(meta[_SCOPES])
        for entry in reversed(scopes[:-1]):
            if entry in names:
                return entry, ""
    return None, ""


def site_of_node(node, model: nn.Module | None) -> str | None:
    """The report site a node's output belongs to, or None when the node carries no module."""
    modules = dict(model.named_modules()) if model is not None else {}
    module, op = node_module(node, set(modules))
    if module is None:
        return None
    owner = modules.get(module)
    if (owner is not None and is_builtin_leaf(owner)) or not op:
        return module
    return site_name(module, op)
