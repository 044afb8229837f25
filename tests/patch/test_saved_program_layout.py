"""A ``.pt2`` written on the CPU runs on CUDA: before torch 2.13, torch.export dropped
nn.MultiheadAttention's ``.contiguous()`` after its SDPA where the CPU's layout made it a
no-op, and the program failed on CUDA ("view size is not compatible", pytorch/pytorch#179287;
seen on an H200 with torch 2.11, tests/test_gpu.py). ``save_model`` puts a copy there.

Without a GPU the CUDA layout is made here: every SDPA output of the loaded program is given
the memory order CUDA's attention kernels return, (batch, length, heads, dim)."""

from __future__ import annotations

import pytest
import torch

from fp16lens.patch import relative_error
from fp16lens.patch import save as save_model

import models

ATEN = torch.ops.aten
LAYOUTS = {ATEN.permute.default, ATEN.transpose.int, ATEN.t.default}


def _with_cuda_layout(module: torch.fx.GraphModule) -> int:
    graph, made = module.graph, 0
    for node in list(graph.nodes):
        if node.target is not ATEN.scaled_dot_product_attention.default:
            continue
        with graph.inserting_after(node):
            swapped = graph.call_function(ATEN.transpose.int, (node, 1, 2))
        with graph.inserting_after(swapped):
            copied = graph.call_function(
                ATEN.clone.default, (swapped,), {"memory_format": torch.contiguous_format}
            )
        with graph.inserting_after(copied):
            back = graph.call_function(ATEN.transpose.int, (copied, 1, 2))
        node.replace_all_uses_with(back, delete_user_cb=lambda user, s=swapped: user is not s)
        made += 1
    module.recompile()
    return made


def _views_of_attention(module: torch.fx.GraphModule) -> list[str]:
    """The views that read an SDPA output through a permute (torch < 2.13's form)."""
    return [
        n.name
        for n in module.graph.nodes
        if n.target is ATEN.view.default
        and getattr(n.args[0], "target", None) in LAYOUTS
        and n.args[0].args[0].target is ATEN.scaled_dot_product_attention.default
    ]


def _bare_export(model, inputs, path):
    with torch.no_grad():
        torch.export.save(torch.export.export(model, inputs), str(path))


@pytest.mark.parametrize("writer", ["fp16lens", "torch.export alone"])
def test_an_attention_program_saved_on_the_cpu_runs_with_cudas_layout(writer, tmp_path):
    model, inputs = models.attention_span()
    path = tmp_path / "m.pt2"
    if writer == "fp16lens":
        save_model(model, inputs, path)
    else:
        _bare_export(model, inputs, path)
    module = torch.export.load(str(path)).module()
    torch_form = _views_of_attention(module)  # before 2.13, and not 2.4: a view of a permute
    assert _with_cuda_layout(module) == 1
    with torch.no_grad():
        want = model(*inputs)
        if writer == "fp16lens" or not torch_form:
            assert not torch_form
            assert relative_error(want, module(*inputs)) <= 1e-6
        else:  # what fp16lens mends: the bare program fails with the CUDA layout
            with pytest.raises(RuntimeError, match="view size is not compatible"):
                module(*inputs)
