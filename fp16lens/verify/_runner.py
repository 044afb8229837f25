"""What verify() asks of a backend: a ``Runner`` runs a candidate on one batch and, when
it can, names the first site where the candidate departs (Polygraphy's ``BaseRunner``
reduced to exactly the calls ``_verify`` makes). Every backend subclasses it; the
registry (``_registry``) says which runner a backend name builds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class Runner(ABC):
    """One backend's way of running a candidate.

    ``name``: the backend it implements (a ``Backend`` member for the built-in ones).
    ``notes``: what the user should know about this run (shown with the result).
    """

    name: ClassVar[str]
    notes: tuple[str, ...] = ()

    @abstractmethod
    def run(self, batch: tuple) -> list[torch.Tensor]:
        """The candidate's output tensors for one batch (positional inputs), flattened in
        the order of the reference model's outputs."""

    def free_axes(self, output: int) -> frozenset[int]:
        """The axes of the candidate's ``output`` (in the reference's order) whose length
        the candidate leaves to the data: where a length may differ from the reference's
        without the candidate being another model's (none unless the backend knows)."""
        return frozenset()

    def locate(self, batch: tuple, site_rel: float) -> tuple[str | None, str | None]:
        """The first diverging site on ``batch`` and, for ONNX backends, its tensor name;
        ``(None, None)`` when this backend cannot localize."""
        return None, None
