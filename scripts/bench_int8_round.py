"""The INT8 search's weight-rounding fit (``export/_int8_round``), timed side by side with
the form it replaced, in one run.

    python scripts/bench_int8_round.py [--models detector,classifier,recognizer,pnet]
                                       [--runs 1] [--search]

The search checks the fitted rounding on held-out halves of the calibration batches: it
needs the codes fitted on the first half, on the second half and, where the rounding is
kept, on every batch. It called ``fit`` three times for them, each a pass over its batches
(every batch's patch products made twice), and GPTQ's column loop ran in torch. Now
``folds`` makes the three from one pass (each batch's products once, the codes fitted on a
half reused as the whole fit's check of it), and the loop runs in NumPy. This script keeps
the loop as it was (``torch_loop_gptq``) and times, interleaved, the best of ``--runs``:
three ``fit`` calls with that loop, and ``folds`` with the loop of the code. Ranges: each
tensor's calibration max. It checks that both give the same codes.

``--search`` times the whole default search (``_int8_search.searcher`` on the 8
calibration items) once in each form, and checks that both make the same plan.

A layer with more than ``_int8_round.SAMPLES`` patches in a batch (easyocr CRAFT's,
NudeNet's YOLOv8n's, DNSMOS's first convs) has them sampled, each ``fit`` call drawing in
turn from its own generator: ``folds`` fits those layers as the three calls do. Items:
``tests/int8_zoo.py``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]


def torch_loop_gptq(rows, scale, hessian):
    """``_int8_round.gptq`` as it was: the column loop in torch."""
    import numpy as np
    import torch

    from fp16lens.export._int8_round import BLOCK, DAMP, QMAX

    w = torch.from_numpy(rows.astype(np.float64)).clone()
    s = torch.from_numpy(scale.astype(np.float64))
    h = torch.from_numpy(hessian.astype(np.float64)).clone()
    k = h.shape[-1]
    eye = torch.eye(k, dtype=h.dtype)
    dead = torch.diagonal(h, dim1=-2, dim2=-1) <= 0
    h = h + eye * dead.unsqueeze(-1).to(h.dtype)
    damp = DAMP * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)
    h = h + damp[:, None, None] * eye
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty_like(w)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        errs = torch.empty_like(w[:, :, start:end])
        for i in range(start, end):
            col = w[:, :, i]
            qi = torch.clamp(torch.round(col / s), -QMAX, QMAX)
            q[:, :, i] = qi
            err = (col - qi * s) / u[:, i, i].unsqueeze(-1)
            errs[:, :, i - start] = err
            w[:, :, i + 1 : end] -= err.unsqueeze(-1) * u[:, i, i + 1 : end].unsqueeze(1)
        if end < k:
            w[:, :, end:] -= errs @ u[:, start:end, end:]
    return q.numpy().astype(np.int8)


def three_fits(proto, units, feeds, scales):
    """``folds`` as the search made it before: ``fit`` on each half and on every batch."""
    from fp16lens.export._int8_round import fit

    half = len(feeds) // 2
    return tuple(fit(proto, units, f, scales) for f in (feeds[:half], feeds[half:], feeds))


@contextlib.contextmanager
def before():
    """The fit as it was, for the span of the block."""
    from fp16lens.export import _int8_round

    kept = _int8_round.gptq, _int8_round.folds
    _int8_round.gptq, _int8_round.folds = torch_loop_gptq, three_fits
    try:
        yield
    finally:
        _int8_round.gptq, _int8_round.folds = kept


def main(argv=None) -> int:
    import int8_zoo

    got = int8_zoo.bench_args(argv, __doc__, "detector,classifier,recognizer,pnet", 1)
    if got is None:
        return 2
    args, names = got

    import numpy as np
    import onnx

    from fp16lens.export import _int8_round
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import find_units, name_nodes
    from fp16lens.export._int8_search import QMAX, collect, searcher

    what, same_what = ("search", "plan") if args.search else ("fit", "codes")
    print(f"| model | {what}, before (s) | {what}, now (s) | before / now | the same {same_what} |")
    print("|---|---|---|---|---|")
    for name in names:
        case = int8_zoo.MODELS[name]()
        feeds = list(case.cal)
        best = {"before": float("inf"), "now": float("inf")}
        got: dict = {}
        for _ in range(args.runs):
            for form in best:
                proto = prepared(onnx.load(case.path))
                name_nodes(proto.graph)
                with before() if form == "before" else contextlib.nullcontext():
                    if args.search:
                        t0 = time.perf_counter()
                        got[form] = int8_zoo.plan_key(searcher(proto, feeds).plan)
                    else:
                        units = find_units(proto.graph, set(), True)
                        hists, _ = collect(proto, units, feeds)
                        scales = {t: h.candidates()["max"] / QMAX for t, h in hists.items()}
                        t0 = time.perf_counter()
                        got[form] = _int8_round.folds(proto, units, feeds, scales)
                best[form] = min(best[form], time.perf_counter() - t0)
        if args.search:
            same = got["before"] == got["now"]
        else:
            same = all(
                sorted(a) == sorted(b) and all(np.array_equal(a[w], b[w]) for w in a)
                for a, b in zip(got["before"], got["now"])
            )
        print(
            f"| {case.name} | {best['before']:.1f} | {best['now']:.1f} | "
            f"{best['before'] / best['now']:.2f} | {'yes' if same else 'NO'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
