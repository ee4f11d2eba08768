import pytest

from pdserve_router.admission import Admission, authenticate
from pdserve_router.errors import APIError

KEYS = frozenset({"sk-alpha", "sk-beta"})


def test_keys_off_accepts_anything():
    assert authenticate(None, frozenset()) == ""


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic sk-alpha", "Bearer sk-alph", "Bearer sk-alpha2"])
def test_missing_or_wrong_key_is_401(header):
    with pytest.raises(APIError) as caught:
        authenticate(header, KEYS)
    assert caught.value.status == 401 and caught.value.code == "invalid_api_key"


def test_any_configured_key_is_accepted_case_insensitive_scheme():
    assert authenticate("Bearer sk-beta", KEYS) == "sk-beta"
    assert authenticate("bearer sk-alpha", KEYS) == "sk-alpha"


def test_over_the_in_flight_bound_is_429_with_retry_after_and_release_frees_a_slot():
    admission = Admission(max_in_flight=2, max_per_key=10, retry_after_s=3)
    first = admission.enter("")
    admission.enter("")
    with pytest.raises(APIError) as caught:
        admission.enter("")
    assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "3"}
    first()
    first()  # releasing twice must not free a second slot
    admission.enter("")
    assert admission.in_flight == 2


def test_per_key_bound_limits_one_key_but_not_another():
    admission = Admission(max_in_flight=10, max_per_key=1, retry_after_s=1)
    admission.enter("sk-alpha")
    with pytest.raises(APIError):
        admission.enter("sk-alpha")
    admission.enter("sk-beta")
