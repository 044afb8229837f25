"""Plain ONNX Runtime runs for the tests' ground truth: a CPU session with graph
optimizations off (they would drop the Cast pairs that store a tensor in FP16), and the
cosines the INT8 tests compare outputs by."""

from __future__ import annotations

import numpy as np


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
