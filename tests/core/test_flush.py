"""The share a flushed weight loses, as the export warning and the report print it."""

from fp16lens._core.flush import percent


def test_a_loss_just_above_fp16_rounding_does_not_print_as_zero():
    assert percent(2.0**-11 * 1.5) == "0.0732%"  # printed "0%" with a whole-percent format
    assert percent(1.0) == "100%" and percent(0.5) == "50%"
