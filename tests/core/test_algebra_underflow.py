"""The pure table of underflow's exact rules (``_core/algebra/_underflow.py``): the numbers
patch's planner chooses j from, checked against arithmetic done here by hand."""

from __future__ import annotations

import math
from fractions import Fraction

from fp16lens._core.algebra import _underflow as alg


def test_exponent_range_from_peaks_and_negative_powers():
    # x (peak 2.42, power 1) and x² (peak 5.86, power 2): 5.86 * 4^j <= 2^14 -> j <= 5
    assert alg.exponent_range([(2.42, Fraction(1)), (5.86, Fraction(2))]) == (1, 5)
    # an rsqrt at 8.19e5 with power -1 needs 2^-j * 8.19e5 <= 2^14: j >= 6
    lo, hi = alg.exponent_range([(8.19e5, Fraction(-1)), (1.0, Fraction(1))])
    assert lo == 6 and hi == 14


def test_step_keeps_every_scale_a_power_of_two():
    assert alg.step_of([Fraction(1), Fraction(2)]) == 1
    assert alg.step_of([Fraction(1), Fraction(-1, 2)]) == 2  # rsqrt of a power-1 value: j even
    assert alg.step_of([Fraction(1, 3)]) == 3


def test_lifted_at_two_to_the_minus_twenty():
    assert alg.lifted(1e-8, Fraction(2), 5)  # 1e-8 * 2^10 = 1.0e-5 >= 2^-20
    assert not alg.lifted(1e-10, Fraction(2), 5)  # 1.0e-7 < 2^-20 (9.5e-7)
    assert not alg.lifted(0.0, Fraction(1), 30)  # below the histogram: unknown, never lifted


def test_log_offset_and_rule_names():
    assert math.isclose(alg.log_offset("log", Fraction(10)), 10 * math.log(2))
    assert alg.log_offset("log2", Fraction(10)) == 10.0
    assert math.isclose(alg.log_offset("log10", Fraction(10)), 10 * math.log10(2))
    assert alg.rule_name("log_", 1) == alg.RULE_LOG
    assert (
        alg.rule_name("truediv", 2) == alg.RULE_RATIO
        and alg.rule_name("atan2", 2) == alg.RULE_RATIO
    )
    assert alg.rule_name("div", 1) == alg.RULE_POWER and alg.rule_name("rsqrt", 1) == alg.RULE_POWER


def test_exponent_of_small_fractions_only():
    assert alg.exponent_of(-0.5) == Fraction(-1, 2) and alg.exponent_of(2) == Fraction(2)
    assert alg.exponent_of(0.1234567) is None and alg.exponent_of(True) is None
