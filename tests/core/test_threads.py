"""fp16lens's own statistics passes run on fewer CPU threads, and the model never sees it:
every op of the user's forward runs with the user's thread count, before, inside and after
a watch block, also when the forward raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16lens import watch
from fp16lens._core import threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Counting(nn.Module):
    """Records the intra-op thread count its forward runs with, between its own ops."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)
        self.seen: list[int] = []
        self.fail = fail

    def forward(self, x):
        self.seen.append(torch.get_num_threads())
        h = torch.relu(self.a(x)) * 3
        self.seen.append(torch.get_num_threads())
        if self.fail:
            raise RuntimeError("planted")
        return self.b(h).softmax(-1)


@pytest.mark.skipif(not threads._adjustable(), reason="thread count fixed by this torch build")
def test_a_small_pass_gets_one_thread_and_the_count_comes_back(two_threads):
    previous = threads.narrow(1000)
    assert torch.get_num_threads() == 1 and previous == 2
    threads.restore(previous)
    assert torch.get_num_threads() == 2
    assert threads.narrow(4 * threads.PER_THREAD) == 0  # worth both threads: unchanged
    assert torch.get_num_threads() == 2
    assert threads.on_threads(lambda t: torch.get_num_threads(), torch.zeros(10)) == 1
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("fail", [False, True])
def test_the_model_runs_with_the_users_thread_count(two_threads, fail):
    model = Counting(fail)
    x = torch.randn(32, 64)
    with torch.no_grad():
        plain = None if fail else model(x)
        model.seen.clear()
        try:
            with watch(model) as lens:
                out = model(x)
        except RuntimeError as err:
            assert fail and "planted" in str(err)
        else:
            assert torch.equal(out, plain) and lens.report.sites
    assert model.seen == [2, 2]
    assert torch.get_num_threads() == 2
