"""Peak memory of scanning an ONNX file: it grows with one batch's intermediates, not with
the number of batches (the verdict's real-FP16 check runs on the first 8 batches at the
end, so 8 and 16 batches peak alike).

    python scripts/bench_onnx_scan.py    # exports a small conv net, scans 1, 8 and 16 batches

Each count runs in a fresh process (peak RSS, ru_maxrss, never goes down); the script
prints the peaks and the size of one batch's float intermediates.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import warnings

SIZE = 192  # input 1x3xSIZExSIZE; 6 conv+relu stages of 32 channels


def _export(path: str) -> None:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()]
    model = nn.Sequential(*layers).eval()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (torch.rand(1, 3, SIZE, SIZE),), path, opset_version=17, dynamo=False
        )


def _child(path: str, batches: int) -> None:
    import torch

    import fp16lens

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    xs = [
        torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(i))
        for i in range(batches)
    ]
    report = fp16lens.scan(path, xs, progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    inter = sum(4 * s.numel // s.calls for s in report.sites.values())
    print(
        json.dumps(
            {
                "batches": report.meta.batches,
                "peak_mib": peak / 1024,
                "grew_mib": (peak - before) / 1024,
                "one_batch_mib": inter / 2**20,
            }
        )
    )


def main() -> None:
    if len(sys.argv) == 3:
        _child(sys.argv[1], int(sys.argv[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "net.onnx")
        _export(path)
        rows = []
        for n in (1, 8, 16):
            out = subprocess.run(
                [sys.executable, __file__, path, str(n)], check=True, capture_output=True, text=True
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        for r in rows:
            print(
                f"{r['batches']} batch(es): peak RSS {r['peak_mib']:.0f} MiB "
                f"(+{r['grew_mib']:.0f} MiB in scan); one batch of intermediates "
                f"{r['one_batch_mib']:.0f} MiB"
            )
        for a, b in ((0, 1), (1, 2)):
            extra = rows[b]["peak_mib"] - rows[a]["peak_mib"]
            print(
                f"{rows[b]['batches']} batches vs {rows[a]['batches']}: {extra:+.0f} MiB "
                f"({extra / rows[0]['one_batch_mib']:.2f} batches' worth of intermediates)"
            )


if __name__ == "__main__":
    main()
