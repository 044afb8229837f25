"""Plain ONNX Runtime runs for the tests' ground truth: a CPU session with graph
optimizations off (they would drop the Cast pairs that store a tensor in FP16), and the
cosines the INT8 tests compare outputs by."""

from __future__ import annotations

import numpy as np

_FLOAT, _HALF = 1, 10  # onnx.TensorProto.FLOAT, FLOAT16


def session(graph):
    """A CPU session of ``graph`` (a ModelProto or a path), optimizations off."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = str(graph) if not hasattr(graph, "SerializeToString") else graph.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) or 1.0))


def worst_cosine(source, graph, feeds) -> float:
    """The lowest cosine of ``graph``'s outputs against ``source``'s over every feed and
    output; each of ``graph``'s outputs must be finite."""
    sessions = session(source), session(graph)
    worst = 1.0
    for feed in feeds:
        for a, b in zip(*(s.run(None, feed) for s in sessions)):
            assert np.isfinite(b).all()
            worst = min(worst, cosine(a, b))
    return worst


def pooled_cosine(source, graph, feeds) -> float:
    """verify's cosine: per output over every feed together, the worst output's."""
    sessions = session(source), session(graph)
    runs = [[s.run(None, feed) for feed in feeds] for s in sessions]
    return min(
        cosine(*(np.concatenate([r[k].ravel() for r in run]) for run in runs))
        for k in range(len(runs[0][0]))
    )


def rounded_twin(path):
    """The typed file computing in FP32, each tensor it types FP16 rounded to FP16 after
    the node that writes it (an explicit Cast pair, kept with optimizations off)."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(path)
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)
    }
    g = m.graph
    for init in g.initializer:
        if init.data_type == _HALF:
            init.CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name)
            )
    nodes = []
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == _HALF:
                a.i = _FLOAT
            if a.name == "value" and a.t.data_type == _HALF:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32)))
        nodes.append(node)
        for k, out in enumerate(node.output):
            if types.get(out) == _HALF:
                raw = f"{out}__raw"
                node.output[k] = raw
                nodes.append(helper.make_node("Cast", [raw], [f"{out}__h"], to=_HALF))
                nodes.append(helper.make_node("Cast", [f"{out}__h"], [out], to=_FLOAT))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    for v in (*g.input, *g.output):
        if v.type.tensor_type.elem_type == _HALF:
            v.type.tensor_type.elem_type = _FLOAT
    return m


def stored_twin(path):
    """The FP32-parts INT8 file with every float tensor a node writes rounded to FP16 after
    that node, its initializers FP32: a weakly typed build with FP16 beside INT8."""
    import onnx
    from onnx import helper

    m = onnx.load(path)
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info,)}
    types.update({v.name: v.type.tensor_type.elem_type for v in m.graph.output})
    nodes = []
    for node in m.graph.node:
        nodes.append(node)
        for k, out in enumerate(node.output):
            if types.get(out) == _FLOAT:
                node.output[k] = f"{out}__raw"
                nodes.append(helper.make_node("Cast", [f"{out}__raw"], [f"{out}__h"], to=_HALF))
                nodes.append(helper.make_node("Cast", [f"{out}__h"], [out], to=_FLOAT))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m
