"""The rescaling algebra (docs/DESIGN.md): how each op commutes with a scale p = 2^k, and
how p is chosen. One home for the rules that the report's advice (``report/_spanfix.py``)
and patch's plan (``patch/_graph.py``, ``_classes.py``, ``_planner.py``) both read.

An op is classified by its aten name (a functional site), by its module (isinstance, for
patch) or by its module's class name (what a report records), and by ONNX op type.
"""

from __future__ import annotations

from fp16lens._core.algebra._aten import (
    DEGREES,
    JOINS,
    PRODUCTS,
    SINGULAR,
    aten_class,
    degree,
    is_join,
    is_product,
    is_singular,
    op_kind,
    product_carrier,
)
from fp16lens._core.algebra._classes import (
    ABSORB_IN,
    ABSORB_OUT,
    KIND_CLASS,
    PASSES,
    Kind,
    OpClass,
)
from fp16lens._core.algebra._factor import (
    TARGET_EXP,
    choose_factor,
    exact_powers,
    needed,
    pow2_ceil,
    pow2_floor,
    rescale_exponent,
)
from fp16lens._core.algebra._modules import (
    eps_name,
    fused_kind,
    input_linear_weight,
    is_batch_norm,
    module_kind,
    module_name_kind,
    norm_has_affine,
    output_linear_child,
    type_kind,
)
from fp16lens._core.algebra._onnx import ONNX_JOINS, onnx_class

__all__ = [
    "ABSORB_IN", "ABSORB_OUT", "DEGREES", "JOINS", "KIND_CLASS", "ONNX_JOINS", "PASSES", "PRODUCTS", "SINGULAR",
    "TARGET_EXP", "Kind", "OpClass", "aten_class", "choose_factor", "degree", "eps_name", "exact_powers",
    "fused_kind", "input_linear_weight", "is_batch_norm", "is_join", "is_product", "is_singular", "module_kind",
    "module_name_kind", "needed", "norm_has_affine", "onnx_class", "op_class", "op_kind", "output_linear_child",
    "pow2_ceil", "pow2_floor", "product_carrier", "rescale_exponent", "site_class", "type_kind",
]  # fmt: skip


def op_class(name: str) -> OpClass:
    """The class of a torch.nn module class name (``Conv2d``) or an aten op (``add``)."""
    kind = module_name_kind(name)
    if kind is not None:
        return KIND_CLASS[kind]
    return aten_class(name) or OpClass.BLOCKING


def site_class(op: str, *, module: bool, producers: int | None) -> OpClass:
    """The class of a report's site as patch will treat it, from what a report records.

    A module site by its class name; a functional site by its aten name, where a join fed
    by one tensor blocks (``producers`` None: unknown, taken as a join) and a functional
    norm blocks (its eps cannot change). A functional conv/linear is taken to absorb:
    patch finds its parameters in a GraphModule (torch.fx, torch.export, onnx2torch) and
    otherwise makes its owner an FP32 island. An ONNX report's sites are modules named by
    op type (``Conv``): classified by ``onnx_class`` (unknown names block there too).
    """
    if module:  # a module class name, else an ONNX node's op type (a scanned .onnx)
        kind = module_name_kind(op)
        return KIND_CLASS[kind] if kind is not None else onnx_class(op)
    return KIND_CLASS[op_kind(op, 2 if producers is None else producers, params=True)]
