import pytest

from pdserve.wire.sampling import SamplingParams


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"top_p": 0.0}, {"top_k": 0}, {"temperature": -1.0}, {"min_p": 2.0}])
def test_out_of_range_values_are_rejected_with_the_field_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
