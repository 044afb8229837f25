"""Statistics merge over torch.distributed ranks (gloo on CPU, two processes)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp16lens import Report, watch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank: int, world: int, port: int, out: str) -> None:
    sys.path.insert(0, HERE)
    import models

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, (x,) = models.clean()
        with torch.no_grad(), watch(model) as lens:
            model(x * (1 + 9 * rank))  # rank 1 sees 10x larger inputs
            if rank == 1:
                model(x)
        lens.report.save(os.path.join(out, f"rank{rank}.json"))
        dist.barrier()  # no rank tears gloo down while the other still talks to it (SIGABRT)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_rank_merge(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (Report.load(tmp_path / f"rank{i}.json") for i in range(2))
    assert r0 == r1, "every rank gets the same merged report"
    assert r0.meta.batches == 3
    import models

    model, (x,) = models.clean()
    with torch.no_grad():
        expected = float(model.features[0](x * 10).abs().max())
    conv = r0.sites["features.0"]
    assert conv.calls == 3 and conv.absmax == pytest.approx(expected)
