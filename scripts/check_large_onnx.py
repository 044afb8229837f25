"""An ONNX model over protobuf's 2 GB limit, end to end: scan, patch, export, verify.

    python scripts/check_large_onnx.py            # a 2.4 GB model (9 MatMuls of 8192x8192)
    python scripts/check_large_onnx.py --layers 2 # a quick 0.5 GB run

Models over 2 GB (a Stable Diffusion UNet, SAM's ViT-H encoder, language models in FP32)
are stored as a graph and a .data file of weights, and no proto over 2 GB can be
serialized. The script writes such a model (its fourth layer's outputs pass 65504 and the
fifth brings them back), runs each CLI stage in its own process and prints, side by side:
its exit code, its time, its peak memory, and that peak as a multiple of the model's
weights and of ONNX Runtime's own peak running the model once. Then it checks the FP16
file the user takes home, without fp16lens: every weight FP16, and its outputs in real
FP16 storage (numpy float16, layer by layer) finite and at cosine > 0.999 against FP32.
Last, the same weights as a PyTorch module exported to FP32 ONNX with each of torch's two
exporters (`fp16lens export chain.py:build --precision fp32`): each file holds its weights
in external data and ONNX Runtime computes the chain from it as FP32 does.
Needs the onnx extra and about 8x the model's size in memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PEAK = (
    "import resource, sys\n"
    "from {module} import {fn}\n"
    "rc = {call}\n"
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc or 0)\n"
)
RUN_ORT = (
    "import resource, sys\n"
    "import numpy as np, onnxruntime as ort\n"
    "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
    "s.run(None, dict(np.load(sys.argv[2])))\n"
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
)


def build(folder: Path, n: int, layers: int) -> tuple[Path, np.ndarray, list[np.ndarray]]:
    """A chain of MatMul + Relu, its weights in model.onnx.data as exporters write them."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    weights, nodes, inits = [], [], []
    offset = 0
    data = folder / "model.onnx.data"
    with open(data, "wb") as f:
        for i in range(layers):
            w = rng.standard_normal((n, n), dtype=np.float32) * np.float32(1.5 / np.sqrt(n))
            if i == layers // 2 - 1:
                w *= np.float32(2.0**14)  # out of FP16's range from here ...
            if i == layers // 2:
                w *= np.float32(2.0**-14)  # ... back in range after this layer
            f.write(w.tobytes())
            weights.append(w)
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[n, n])
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", offset), ("length", w.nbytes)):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            offset += w.nbytes
            inits.append(t)
            src = "x" if i == 0 else f"r{i - 1}"
            nodes.append(helper.make_node("MatMul", [src, f"w{i}"], [f"m{i}"], name=f"mm{i}"))
            nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}"))
    graph = helper.make_graph(
        nodes,
        "large",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, n])],
        [helper.make_tensor_value_info(f"r{layers - 1}", TensorProto.FLOAT, [4, n])],
        inits,
    )
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = np.abs(rng.standard_normal((4, n), dtype=np.float32))
    np.savez(folder / "x.npz", x=x)
    return path, x, weights


CHAIN = """import numpy as np, torch


class Chain(torch.nn.Module):
    \"\"\"The ONNX chain's weights (read from its .data file) as a PyTorch module.\"\"\"

    def __init__(self):
        super().__init__()
        data = np.memmap({data!r}, dtype=np.float32, mode="r")
        n = {n}
        self.w = torch.nn.ParameterList(
            torch.nn.Parameter(torch.from_numpy(np.array(data[i * n * n : (i + 1) * n * n]).reshape(n, n)), requires_grad=False)
            for i in range({layers})
        )

    def forward(self, x):
        for w in self.w:
            x = torch.relu(x @ w)
        return x


def build():
    return Chain().eval(), (torch.from_numpy(np.load({xs!r})["x"]),)
"""


def from_torch(folder: Path, n: int, layers: int, xs: str, ref: np.ndarray, size: float) -> int:
    """Export the chain as a PyTorch module with each exporter; 0 when both files compute it."""
    import onnx
    import onnxruntime as ort

    chain = folder / "chain.py"
    data = str(folder / "model.onnx.data")
    chain.write_text(CHAIN.format(data=data, n=n, layers=layers, xs=xs))
    failed = 0
    for exporter in ("torchscript", "dynamo"):
        out = folder / f"torch_{exporter}.onnx"
        argv, code = cli(
            "export",
            f"{chain}:build",
            "--precision",
            "fp32",
            "--exporter",
            exporter,
            "-o",
            str(out),
        )
        peak = stage(f"{exporter}", argv, code, size, None)
        if peak != peak:
            failed += 1
            continue
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: np.load(xs)["x"]})[0]
        graph = onnx.load(str(out), load_external_data=False).graph
        external = all(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        ok = external and err < 1e-5
        print(
            f"  {out.name}: {out.stat().st_size / 1e6:.2f} MB graph, external data "
            f"{'yes' if external else 'NO'}, max error {err:.1e} of the output's peak: "
            f"{'holds' if ok else 'FAILS'}",
            flush=True,
        )
        failed += not ok
        del session
        for p in folder.iterdir():
            if p.name.startswith("torch_"):
                p.unlink()
    return failed


def stage(name: str, argv: list[str], code: str, size: float, ort_peak: float | None) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - t0
    peaks = [
        int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("PEAK_KB")
    ]
    peak = peaks[-1] * 1024 / 1e9 if peaks else float("nan")
    versus = f"{peak / ort_peak:5.1f}x ORT" if ort_peak else "         "
    print(
        f"{name:10s} exit {done.returncode}  {seconds:7.1f} s  peak {peak:6.2f} GB  "
        f"{peak / size:5.1f}x the weights  {versus}",
        flush=True,
    )
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    return peak


def cli(*argv: str) -> tuple[list[str], str]:
    code = PEAK.format(module="fp16lens.cli", fn="main", call="main(sys.argv[1:])")
    return list(argv), code


def real_fp16(path: Path, x: np.ndarray) -> np.ndarray:
    """The FP16 file's chain computed in numpy float16 (each MatMul's output stored in
    FP16, accumulated in FP32 as GPUs do), reading its weights as the file holds them."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert all(a.dtype == np.float16 for a in inits.values()), "a weight is not FP16"
    h = x.astype(np.float16)
    for node in proto.graph.node:
        if node.op_type == "MatMul":
            w = inits[node.input[1]]
            with np.errstate(over="ignore"):
                h = (h.astype(np.float32) @ w.astype(np.float32)).astype(np.float16)
        elif node.op_type == "Relu":
            h = np.maximum(h, np.float16(0))
    return h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192, help="each weight is n x n")
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--dir", help="keep the files here (default: a temporary folder)")
    parser.add_argument(
        "--no-torch", action="store_true", help="skip the PyTorch exports (about 2 minutes)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        path, x, weights = build(folder, args.n, args.layers)
        size = sum(w.nbytes for w in weights) / 1e9
        ref = x
        for w in weights:
            ref = np.maximum(ref @ w, 0)
        del weights
        print(f"model: {path.name} + {path.name}.data, {size:.2f} GB of weights", flush=True)
        xs = str(folder / "x.npz")
        ort_peak = stage("onnxruntime", [str(path), xs], RUN_ORT, size, None)
        report, fixed, half = folder / "r.json", folder / "fixed.onnx", folder / "fixed16.onnx"
        failed = 0
        for name, (argv, code) in (
            ("scan", cli("scan", str(path), "--input", xs, "--save", str(report))),
            ("patch", cli("patch", str(path), "--report", str(report), "--input", xs, "-o", str(fixed))),
            ("export", cli("export", str(fixed), "--precision", "fp16", "-o", str(half), "--input", xs)),
            ("verify", cli("verify", str(path), str(half), "--input", xs)),
        ):  # fmt: skip
            peak = stage(name, argv, code, size, ort_peak)
            failed += peak != peak  # nan: the stage did not finish
        got = real_fp16(half, x)
        a, b = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        ok = bool(np.isfinite(got).all()) and cosine > 0.999
        print(
            f"the FP16 file in real FP16 storage: finite {bool(np.isfinite(got).all())}, "
            f"cosine {cosine:.6f} against FP32: {'holds' if ok else 'FAILS'}"
        )
        for p in (report, fixed, half):
            for q in folder.glob(p.name + "*"):
                q.unlink()
        if not args.no_torch:
            failed += from_torch(folder, args.n, args.layers, xs, ref, size)
        return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
