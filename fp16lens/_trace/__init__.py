"""Tracing under the stages (layer 1): what watch, patch and verify all read of a running
torch model, so that none of them reaches into another.

- aten ops: their display names and classes (``op_name``, ``FACTORY``, ``PASSTHROUGH``, ...);
- module attribution: which module runs an op (``ModuleTracker``, ``Frame``);
- the dtypes a ``.half()`` model computes in, from one run on the ``meta`` device
  (``fp32_compute_ops``, ``compute_index``, ``FirstCall``), and where it cannot run
  (``HalfFails``);
- the fx node running an op of a GraphModule's forward (``graph_forwards``, ``running_node``);
- calling a model on one batch (``call_model``, its arguments ``call_args``) and its float outputs (``float_outputs``).
"""

from fp16lens._trace._call import call_args, call_model, float_outputs
from fp16lens._trace._fxnames import graph_forwards, model_class, running_node
from fp16lens._trace._half import (
    HALF_FAILS,
    FirstCall,
    HalfFails,
    compute_index,
    first_float,
    fp32_compute_ops,
    run_half_on_meta,
)
from fp16lens._trace._ops import (
    BOUNDARY_MODULES,
    FACTORY,
    MATMUL_LIKE,
    MONOTONE,
    NORM_OPS,
    PASSTHROUGH,
    VALUE_PRESERVING,
    is_builtin_leaf,
    op_name,
)
from fp16lens._trace._tracker import Frame, ModuleTracker, pause_at_boundary

__all__ = [
    "BOUNDARY_MODULES", "FACTORY", "HALF_FAILS", "MATMUL_LIKE", "MONOTONE", "NORM_OPS", "PASSTHROUGH",
    "VALUE_PRESERVING", "FirstCall", "Frame", "HalfFails", "ModuleTracker", "call_args", "call_model", "compute_index",
    "first_float", "float_outputs", "fp32_compute_ops", "graph_forwards", "is_builtin_leaf", "model_class",
    "op_name", "pause_at_boundary", "run_half_on_meta", "running_node",
]  # fmt: skip
