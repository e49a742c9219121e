"""Early rejection: per-request decisions, and the anti-phase oscillation that rejecting on current
decode load causes and prediction removes (a small simulation on a simulated clock)."""

import pytest

from mooncake.conductor.admission import make_admission_policy
from mooncake.conductor.estimators import DecodeStepModel
from mooncake.conductor.view import ClusterView, DecodeLoad, DecodeView, Placement, PrefillView, RequestView
from mooncake.errors import BackendError

# TBT = 10 ms per request in the batch; with a 100 ms SLO a decode instance holds 10 requests.
STEP = DecodeStepModel(0.0, 0.01, 0.0)
TTFT_SLO, TBT_SLO = 30.0, 0.1
REQUEST = RequestView("r", num_tokens=1000, block_hashes=())


def placement(ttft_s=4.0):
    return Placement("p0", "d0", 0, None, ttft_s=ttft_s, tbt_s=0.0)


def view(requests):
    return ClusterView([PrefillView("p0")], [DecodeView("d0", requests)], block_size=512, block_bytes=1)


def policy(name):
    return make_admission_policy(name, STEP, TTFT_SLO, TBT_SLO)


def test_early_rejection_judges_current_decode_load():
    busy_now_free_later = view([DecodeLoad(0, 2.0, 100)] * 10)  # 10 decoding, all done in 2 s
    assert policy("early").admit(REQUEST, placement(), busy_now_free_later, now=0.0).reason == "tbt_slo"
    # the request reaches decode in 4 s, when those 10 are gone: prediction admits it
    assert policy("predictive").admit(REQUEST, placement(), busy_now_free_later, now=0.0) is None


def test_predictive_counts_requests_still_in_prefill():
    free_now_busy_later = view([DecodeLoad(2.0, 60.0, 100)] * 10)  # 10 will enter decode in 2 s
    assert policy("early").admit(REQUEST, placement(), free_now_busy_later, now=0.0) is None
    rejection = policy("predictive").admit(REQUEST, placement(), free_now_busy_later, now=0.0)
    assert rejection.reason == "tbt_slo" and rejection.tbt_s == pytest.approx(0.11)


def test_a_request_that_would_decode_alone_is_never_rejected_for_tbt():
    slow = make_admission_policy("predictive", DecodeStepModel(0.5, 0.0, 0.0), TTFT_SLO, TBT_SLO)  # 500 ms steps
    assert slow.admit(REQUEST, placement(), view([]), now=0.0) is None
    rejection = slow.admit(REQUEST, placement(), view([DecodeLoad(0, 60, 100)]), now=0.0)
    assert rejection.reason == "tbt_slo" and rejection.tbt_s == pytest.approx(0.5)


def test_ttft_slo_and_accept_all():
    assert policy("early").admit(REQUEST, placement(ttft_s=31.0), view([]), 0).reason == "ttft_slo"
    assert policy("predictive").admit(REQUEST, placement(ttft_s=31.0), view([]), 0).reason == "ttft_slo"
    assert policy("accept-all").admit(REQUEST, placement(ttft_s=99.0), view([DecodeLoad(0, 9, 1)] * 50), 0) is None
    with pytest.raises(BackendError, match="unknown admission backend .maybe."):
        policy("maybe")


def simulate(name, seconds=300, prefill_s=4.0, decode_s=20.0):
    """One request arrives per second (twice what decode can hold), prefill takes 4 s, decoding 20 s.
    Returns the decode load (TBT / SLO) of each second, as the step model predicts it from the batch."""
    admission = policy(name)
    requests: list[DecodeLoad] = []
    loads = []
    for t in range(seconds):
        now = float(t)
        cluster = view(requests)
        if admission.admit(REQUEST, placement(ttft_s=prefill_s), cluster, now) is None:
            requests.append(DecodeLoad(now + prefill_s, now + prefill_s + decode_s, 0))
        batch, _ = cluster.decodes[0].batch_at(now)
        loads.append(STEP.predict(batch, 0) / TBT_SLO)
    return loads[60:]  # after warm-up


def test_prediction_damps_the_oscillation_of_rejecting_on_current_load():
    current = simulate("early")
    predicted = simulate("predictive")
    # Admitting on current load lets in every request that arrives while earlier ones are still in
    # prefill: decode overshoots to 1.4x its SLO, then drains far below it while everything is rejected.
    assert max(current) >= 1.25
    assert max(current) - min(current) >= 0.5
    # Predicting the load at the moment a request reaches decode keeps it at or under the SLO, steadily.
    assert max(predicted) <= 1.0 + 1e-9
    assert max(predicted) - min(predicted) <= 0.2
    assert sum(predicted) / len(predicted) >= 0.85  # and it does not get there by starving decode
