"""Overflow spans on the dataflow graph of one forward call.

A span starts at an op whose inputs are in FP16 range and whose output is not, grows
through every op fed by out-of-range values, and ends at each op where out-of-range
inputs give an in-range output (or at the model output). Model inputs count as in
range here: out-of-range inputs are reported as input problems instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ForwardSpan:
    """A span in event ids of one forward call."""

    starts: list[int]
    members: list[int]
    ends: list[int] = field(default_factory=list)
    reaches_output: bool = False


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def find_spans(
    oor: list[bool], inputs: list[tuple[int, ...]], is_input: list[bool], outputs: tuple[int, ...]
) -> list[ForwardSpan]:
    """Group out-of-range events into connected spans (events are in execution order)."""
    n = len(oor)
    hot = [oor[e] and not is_input[e] for e in range(n)]
    parent = list(range(n))
    for e in range(n):
        if hot[e]:
            for p in inputs[e]:
                if hot[p]:
                    parent[_find(parent, p)] = _find(parent, e)
    spans: dict[int, ForwardSpan] = {}
    for e in range(n):
        if hot[e]:
            root = _find(parent, e)
            span = spans.setdefault(root, ForwardSpan(starts=[], members=[]))
            span.members.append(e)
            if not any(hot[p] for p in inputs[e]):
                span.starts.append(e)
        else:
            for root in {_find(parent, p) for p in inputs[e] if hot[p]}:
                spans[root].ends.append(e)
    out = set(outputs)
    for span in spans.values():
        span.reaches_output = any(m in out for m in span.members)
    return sorted(spans.values(), key=lambda s: s.members[0])
