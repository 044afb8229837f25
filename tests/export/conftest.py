"""Exports shared by the export tests: the dynamo exporter takes seconds, so export once."""

from __future__ import annotations

import types

import numpy as np
import pytest

from models import seed_case


@pytest.fixture(scope="session")
def seed():
    return seed_case(size=64)


@pytest.fixture(scope="session")
def seed_fp32(seed, tmp_path_factory):
    pytest.importorskip("onnxscript")
    from fp16lens.export import export

    model, inputs = seed
    return export(model, inputs, tmp_path_factory.mktemp("seed") / "seed_fp32.onnx", "fp32")


@pytest.fixture(scope="session")
def seed_fp16(seed_fp32):
    """The seed case in FP16: the FP32 export re-typed (export(..., "fp16") runs the same
    conversion after the same export; one dynamo export of resnet18 is enough)."""
    from fp16lens.export import retype

    return retype(seed_fp32.path, seed_fp32.path.with_name("seed_fp16.onnx"), "fp16")


@pytest.fixture(scope="session")
def ox():
    """Helpers for reading exported graphs (onnx and ONNX Runtime are needed)."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    return types.SimpleNamespace(
        onnx=onnx,
        ort=ort,
        FLOAT=onnx.TensorProto.FLOAT,
        FLOAT16=onnx.TensorProto.FLOAT16,
        elem_types=lambda model: _elem_types(onnx, model),
        run=lambda *a, **k: _run(onnx, ort, *a, **k),
    )


def _elem_types(onnx, model) -> dict[str, int]:
    """Element type of every tensor, from ONNX's own shape inference."""
    g = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types_ = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types_.update({i.name: i.data_type for i in g.initializer})
    return types_


def _run(onnx, ort, path, feeds: dict[str, np.ndarray], extra=(), level=None) -> dict:
    """Run a model in ONNX Runtime CPU, also returning the ``extra`` intermediate tensors."""
    model = onnx.load(str(path))
    outputs = [o.name for o in model.graph.output]
    for name in extra:
        if name not in outputs:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
            outputs.append(name)
    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return dict(zip(outputs, session.run(outputs, feeds)))


@pytest.fixture(scope="session")
def int8_prepared():
    """``make(name, n_cal, n_eval)`` -> (an ``int8_zoo`` case, its FP32 graph prepared for
    INT8 with named nodes, its units); skips where the model's wheel is missing."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import int8_zoo
    from zoo_real import Missing

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import find_units, name_nodes

    def make(name: str, n_cal: int = 2, n_eval: int = 2):
        try:
            case = int8_zoo.MODELS[name](n_cal, n_eval)
        except Missing as exc:
            pytest.skip(str(exc))
        proto = prepared(onnx.load(case.path))
        name_nodes(proto.graph)
        return case, proto, find_units(proto.graph, set())

    return make


@pytest.fixture(scope="session")
def bench_search():
    """``bench_search(name, centre=True)``: (case, prepared graph, Searcher) of an INT8 zoo
    model as ``scripts/bench_int8.py`` searches it (8 calibration items, 24 evaluation items,
    2 probe batches), made once per session: the detector's and recognizer's searches take
    minutes each on this project's CPU, and several tests read the same one."""
    made: dict = {}

    def get(name: str, centre: bool = True):
        pytest.importorskip("onnxruntime")
        onnx = pytest.importorskip("onnx")
        import int8_zoo
        from zoo_real import Missing

        from fp16lens.export._int8 import prepared
        from fp16lens.export._int8_place import name_nodes
        from fp16lens.export._int8_search import searcher

        if (name, centre) not in made:
            try:
                case = int8_zoo.MODELS[name](8, 24)
            except Missing as exc:
                pytest.skip(str(exc))
            proto = prepared(onnx.load(case.path))
            name_nodes(proto.graph)
            found = searcher(proto, list(case.cal), search_batches=2, centre=centre)
            made[name, centre] = (case, proto, found)
        return made[name, centre]

    return get
