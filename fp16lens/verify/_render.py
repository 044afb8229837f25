"""Rich rendering of a ParityResult (Rich's ``__rich_console__`` protocol)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def render(result):
    verdict = (
        Text("PASSED", style="bold green") if result.passed else Text("FAILED", style="bold red")
    )
    head = Text.assemble(
        "Parity ", verdict, f"  backend {result.backend}, {result.batches} batch(es)"
    )
    yield head
    table = Table(show_edge=False, pad_edge=False)
    about = any(_hidden(m) for m in result.outputs.values())
    columns = ("output", "cosine", *(("about mean",) if about else ()), "max abs", "max rel")
    for col in (*columns, "SQNR dB", "top-1 agree", "finite"):
        table.add_column(col, justify="left" if col == "output" else "right")
    for name, m in result.outputs.items():
        table.add_row(
            name,
            _num(m.cosine, ".6f"),
            *((_num(m.cosine_about_mean, ".6f"),) if about else ()),
            _num(m.max_abs, ".3g"),
            _num(m.max_rel, ".3g"),
            _num(m.sqnr_db, ".1f"),
            _num(m.topk_agreement, ".3f"),
            Text("no", style="red") if m.nonfinite else "yes",
        )
    yield table
    if result.first_divergence:
        tensor = (
            f" (ONNX tensor {result.first_divergence_tensor})"
            if result.first_divergence_tensor
            else ""
        )
        yield Text(f"first divergence: {result.first_divergence}{tensor}")
    for name, value in result.metrics.items():
        yield Text(f"metric {name}: {value:.6g}")
    for line in result.failures():
        yield Text(f"  {line}", style="red")
    for line in result.advice:
        yield Text(line, style="yellow")
    for note in result.notes:
        yield Text(f"note: {note}", style="dim")


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _hidden(m) -> bool:
    """Whether an output's cosine about FP32's mean says what its plain cosine hides."""
    return (
        m.cosine is not None
        and m.cosine_about_mean is not None
        and (m.cosine_about_mean < m.cosine - 1e-4)
    )
