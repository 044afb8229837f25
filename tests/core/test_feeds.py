"""``declared_batch`` and ``split_to_declared``: a file's one batch of N items fed to a
graph whose first axis is fixed (1 for a graph exported to take one item at a time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp16lens._core.feeds import declared_batch, split_to_declared

onnx = pytest.importorskip("onnx")


def _graph(*firsts):
    from onnx import TensorProto, helper

    inputs = [
        helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [f, 4] if f != "" else None)
        for i, f in enumerate(firsts)
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Identity", ["x0"], ["y"])]
    weight = helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    graph = helper.make_graph(
        nodes,
        "g",
        [*inputs, helper.make_tensor_value_info("w", TensorProto.FLOAT, [3])],
        [out],
        [weight],
    )
    return helper.make_model(graph)


def test_the_declared_first_axis_is_read_from_a_proto_and_a_file(tmp_path):
    assert declared_batch(_graph(1)) == 1
    assert declared_batch(_graph(4, 4)) == 4  # the initializer "w" (first axis 3) is no input
    assert declared_batch(_graph("batch")) is None  # a free axis
    assert declared_batch(_graph(1, 2)) is None  # inputs that differ
    assert declared_batch(_graph("")) is None  # no shape declared
    onnx.save(_graph(1), tmp_path / "g.onnx")
    assert declared_batch(tmp_path / "g.onnx") == 1 == declared_batch(str(tmp_path / "g.onnx"))
    assert declared_batch(tmp_path / "missing.onnx") is None


def test_one_batch_is_split_in_its_own_form():
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    b = np.arange(6)
    parts, note = split_to_declared([{"x": a, "ids": b}], 1)
    assert len(parts) == 6 and note.startswith("the batch of 6 items split into its items")
    assert all(p["x"].shape == (1, 4) and p["ids"].shape == (1,) for p in parts)
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), a)
    parts, note = split_to_declared([(torch.from_numpy(a), torch.from_numpy(b))], 2)
    assert [type(p) for p in parts] == [tuple] * 3 and "3 batches of 2" in note
    assert torch.equal(torch.cat([p[0] for p in parts]), torch.from_numpy(a))
    parts, _ = split_to_declared([a], 3)
    assert [p.shape for p in parts] == [(3, 4), (3, 4)]


@pytest.mark.parametrize(
    "batches, size",
    [
        ([np.zeros((6, 4))], 4),  # 4 does not divide 6: refused by the graph, as given
        ([np.zeros((1, 4))], 1),  # already one item
        ([np.zeros((2, 4))], 4),  # fewer items than the graph's batch
        ([np.zeros((4, 4)), np.zeros((4, 4))], 1),  # several batches: the user's own split
        ([(np.zeros((4, 4)), np.zeros((3, 4)))], 1),  # inputs of different lengths
        ([np.zeros((4, 4))], None),  # a free first axis
    ],
)
def test_anything_else_is_left_as_it_is(batches, size):
    got, note = split_to_declared(batches, size)
    assert got is batches and note == ""
