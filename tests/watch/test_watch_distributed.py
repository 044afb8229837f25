"""Statistics merge over torch.distributed ranks (gloo on CPU, two processes)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp16lens import Report, watch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank: int, world: int, out: str) -> None:
    sys.path.insert(0, HERE)
    import models

    # A rank that hangs prints where it waits and exits: the CI log then names the call.
    faulthandler.dump_traceback_later(120, exit=True)
    # gloo on loopback: left to itself it takes the address the hostname resolves to,
    # which on some machines is an interface the other rank cannot reach (a connect that
    # waits out gloo's 30-minute default)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # a file store, not a TCP one: no rank hosts it, so none can leave while another still
    # needs it (torch 2.4.1's destroy_process_group hung on rank 0's TCP store, gone)
    store = os.path.join(out, "store")
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"file://{store}",
        timeout=datetime.timedelta(seconds=60),  # a collective that waits longer raises
    )
    model, (x,) = models.clean()
    with torch.no_grad(), watch(model) as lens:
        model(x * (1 + 9 * rank))  # rank 1 sees 10x larger inputs
        if rank == 1:
            model(x)
    lens.report.save(os.path.join(out, f"rank{rank}.json"))
    dist.barrier()  # both reports are written; no rank leaves while the other still talks
    # gloo's teardown is left to the OS: destroy_process_group, and the process group's
    # destructor at exit, hang now and then (pytorch#75097; torch 2.4.1 under load here)
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_rank_merge(tmp_path):
    import time

    ranks = mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 180  # a hung rank fails the test, not the whole run
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("a rank did not finish within 180 s (gloo hung)")
    r0, r1 = (Report.load(tmp_path / f"rank{i}.json") for i in range(2))
    assert r0 == r1, "every rank gets the same merged report"
    assert r0.meta.batches == 3
    import models

    model, (x,) = models.clean()
    with torch.no_grad():
        expected = float(model.features[0](x * 10).abs().max())
    conv = r0.sites["features.0"]
    assert conv.calls == 3 and conv.absmax == pytest.approx(expected)
