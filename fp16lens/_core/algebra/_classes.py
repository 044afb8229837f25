"""The classes of the rescaling algebra and patch's finer kinds (docs/DESIGN.md).

For a scale p = 2^k an op is *absorbing* (its parameters take 1/p at an entry of a region
and p at an exit), *homogeneous* (f(px) = p f(x): the scale passes), *invariant*
(f(px) = f(x) once eps -> eps/p^2: a natural exit) or *blocking* (no scale passes).
"""

from __future__ import annotations

from fp16lens._core.sites import _Names


class OpClass(_Names):
    """How an op commutes with a power-of-two scale."""

    ABSORBING = "absorbing"  # conv, linear, batch norm (eval): W/p, b/p at an entry, pW at an exit
    HOMOGENEOUS = "homogeneous"  # f(px) = p f(x): a scale passes through
    INVARIANT = "invariant"  # f(px) = f(x) with eps/p^2: layer/group/instance/RMS norm
    BLOCKING = "blocking"  # sigmoid, tanh, gelu, silu, exp, softmax, pow(x, tensor), unknown


class Kind(_Names):
    """What patch can do at one site: the class, refined by the module or the dataflow."""

    LINEAR = "linear"  # conv / linear with reachable parameters: absorbs 1/p in, p out
    BN = "bn"  # batch norm in eval with running statistics: absorbs both ways
    NORM = "norm"  # layer/group/instance/RMS norm module: eps / p^2; affine ones absorb out
    HOMOG = "homog"  # one scale flows through
    JOIN = "join"  # several operands that must carry the same scale (add, sub, cat, max)
    POWER = "power"  # homogeneous of a degree d != 1 (x**2, sqrt, rsqrt): scale p -> p^d
    BLOCK = "block"  # a module no scale passes: a scaled FP32 island
    OPAQUE = "opaque"  # a functional op no scale passes and no module wraps


KIND_CLASS = {
    Kind.LINEAR: OpClass.ABSORBING,
    Kind.BN: OpClass.ABSORBING,
    Kind.NORM: OpClass.INVARIANT,
    Kind.HOMOG: OpClass.HOMOGENEOUS,
    Kind.JOIN: OpClass.HOMOGENEOUS,
    Kind.POWER: OpClass.HOMOGENEOUS,
    Kind.BLOCK: OpClass.BLOCKING,
    Kind.OPAQUE: OpClass.BLOCKING,
}
"""The class each kind belongs to: what the report advises for a site patch sees as a kind."""

ABSORB_OUT = frozenset({Kind.LINEAR, Kind.BN, Kind.BLOCK})
"""Kinds whose output scale can be chosen freely (BLOCK as a scaled FP32 island)."""
ABSORB_IN = frozenset({Kind.LINEAR, Kind.BN, Kind.NORM, Kind.BLOCK})
"""Kinds whose input scale can be absorbed (exits of a region)."""
PASSES = frozenset({Kind.HOMOG, Kind.JOIN, Kind.POWER})
"""Kinds a scale passes through: members of a region that are neither entries nor exits."""
