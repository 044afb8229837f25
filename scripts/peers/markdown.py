"""The "Compared with" section of docs/benchmarks.md, rendered from bench_peers' result tables."""

from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = (
    "torch",
    "onnx",
    "onnxruntime",
    "nvidia-modelopt",
    "onnxconverter-common",
    "transformers",
)

INTROS = {
    "finding": (
        "Which tool finds which problem, and how precisely it names the site. Real FP16 is "
        "the ground truth (first op producing inf in `.half()` on the CPU, an explicit "
        "decomposed FP16 LayerNorm, the buffer in half)."
    ),
    "overhead": "Time of one forward under each tool divided by a plain forward.",
    "fixing": (
        "Every fix starts from the same FP32 ONNX graph (`fp16lens.export(..., "
        'precision="fp32")`, torch\'s dynamo exporter); fp16lens exports its patched model. '
        "**FP16 FLOPs %**: share of the Conv/Gemm/MatMul FLOPs (2 x MACs from ONNX shape "
        "inference) whose inputs are FP16 -- more runs on TensorRT's FP16 tensor cores. "
        "**parity / cosine / non-finite**: `fp16lens.verify(model, onnx_path, inputs, "
        'backend="onnx-fp16")`, which computes each node in FP32 and stores every tensor the '
        "file types FP16 through a real FP16 round trip; it reads only the tensor types, so it "
        "works on the Casts other tools write (the *no fix* rows fail where real FP16 "
        "overflows). **extra nodes**: node count minus the FP32 graph's. **FP32 nodes**: "
        "non-Cast nodes with an FP32 output. AutoCast is calibrated on the same inputs; its "
        "tuned row is the largest `data_max` tried that passes parity. onnxconverter-common "
        "blocks the nodes of the problem sites (`node_block_list`), as a user who knows the "
        "span would."
    ),
    "exactness": (
        "FP32 error (max|err| / max|truth|, truth in float64) of folding the power-of-two "
        "factor p into the parameters versus the seed article's runtime forms "
        "`p*conv(x/p) - (p-1)*b` (warp_conv), the same for a batch norm (warp_bn) and "
        "`p*w2(relu((w1 x + b1)/p)) - (p-1)*b2` (span formula)."
    ),
}


def versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def table(rows: list[dict]) -> str:
    if not rows:
        return "_(no rows)_\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def compared_with(result: dict[str, list[dict]], mode: str, argv: list[str]) -> str:
    """Markdown: one subsection per table, with the command that regenerates it."""
    command = " ".join(["python scripts/bench_peers.py", *_without_markdown(argv)])
    parts = [
        "## Compared with\n",
        f"Regenerate with `{command}` ({mode} mode; measured on {platform.machine()} CPU, "
        f"Python {platform.python_version()}, {versions()}).\n",
    ]
    for name, rows in result.items():
        parts += [f"### {name.capitalize()}\n", INTROS.get(name, "") + "\n", table(rows)]
    return "\n".join(parts)


def _without_markdown(argv: list[str]) -> list[str]:
    """The command line minus ``--markdown PATH`` (the section shows how to get the tables)."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--markdown="):
            skip = False
            continue
        skip = arg == "--markdown"
        if not skip:
            out.append(arg)
    return out
