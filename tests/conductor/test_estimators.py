import random

import pytest

from mooncake.conductor.estimators import BandwidthEstimator, DecodeStepModel, OutputLengthModel, PrefillTimeModel
from mooncake.conductor.prefix_index import PrefixIndex


def test_prefill_model_fits_measurements_online():
    model = PrefillTimeModel(0.0, 1e-3, 0.0, min_samples=8)  # seed: 1 ms per token, wrong on purpose
    rng = random.Random(0)
    for _ in range(50):  # truth: 20 ms + 0.2 ms/token + 1e-8 s/token^2 over the uncached part
        n = rng.randint(100, 8000)
        r = rng.randint(0, n)
        model.observe(n, r, 0.02 + 2e-4 * (n - r) + 1e-8 * (n * n - r * r))
    assert model.predict(4000, 0) == pytest.approx(0.02 + 2e-4 * 4000 + 1e-8 * 4000**2, rel=1e-3)
    assert model.predict(4000, 3000) < model.predict(4000, 0)
    assert model.predict(100, 500) == pytest.approx(0.02, abs=1e-3)  # reuse beyond the prompt is capped


def test_seed_is_used_until_enough_samples():
    model = PrefillTimeModel(0.5, 0.0, 0.0, min_samples=3)
    model.observe(100, 0, 9.0)
    assert model.predict(100) == 0.5
    model.observe(200, 0, 9.0)
    model.observe(300, 0, 9.0)
    assert model.predict(100) == pytest.approx(9.0, rel=0.01)  # fitted as soon as there are enough


def test_decode_step_model():
    model = DecodeStepModel(0.01, 0.001, 1e-6, min_samples=4)
    assert model.predict(0, 0) == 0.0
    for batch in range(1, 20):
        model.observe(batch, batch * 500, 0.005 + 0.002 * batch + 2e-6 * batch * 500)
    assert model.predict(10, 5000) == pytest.approx(0.005 + 0.02 + 0.01, rel=1e-3)


def test_bandwidth_moving_average_per_pair():
    bw = BandwidthEstimator(1e9, alpha=0.5)
    assert bw.get("a", "b") == 1e9
    bw.observe("a", "b", 4e9, 1.0)
    bw.observe("a", "b", 2e9, 1.0)
    assert bw.get("a", "b") == pytest.approx(3e9) and bw.get("b", "a") == 1e9


def test_prefix_index():
    index = PrefixIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2])
    index.add("c", [2, 3])  # has a later block but not the first: no prefix
    assert index.prefix_lengths([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.prefix_lengths([9]) == {}
    assert index.prefix_len([1, 2, 3], "b") == 2 and index.prefix_len([1], "c") == 0
    index.drop_holder("a")
    assert index.prefix_lengths([1, 2, 3]) == {"b": 2} and len(index) == 3


def test_the_fit_follows_the_last_window_only():
    """Samples that left the window no longer count: a box that became twice as slow is learnt within a
    window (the running sums subtract what leaves and are summed afresh once per window)."""
    model = PrefillTimeModel(0.0, 1e-3, 0.0, window=32, min_samples=8)
    rng = random.Random(1)
    for slow in (1.0, 2.0):
        for _ in range(100):
            n = rng.randint(100, 8000)
            model.observe(n, 0, slow * (0.02 + 2e-4 * n + 1e-8 * n * n))
    assert model.predict(4000) == pytest.approx(2 * (0.02 + 2e-4 * 4000 + 1e-8 * 4000**2), rel=1e-3)


def test_an_instance_may_seed_a_model_until_samples_come():
    model = DecodeStepModel(0.01, 0.0, 0.0, min_samples=2)
    assert model.seed([0.03, 0.001, 1e-6]) and model.predict(4, 1000) == pytest.approx(0.03 + 0.004 + 0.001)
    model.observe(4, 1000, 0.05)
    assert not model.seed([1.0, 1.0, 1.0])  # measured samples win over what an instance says
    assert not DecodeStepModel(0.01, 0.0, 0.0).seed([0.01, -1.0, 0.0])  # nonsense is ignored


def test_output_lengths_are_learned_from_answers_that_ended_never_taken_from_the_cap():
    model = OutputLengthModel(prior_tokens=100, min_samples=16)
    assert model.left(0, 2000) == 100 and model.left(30, 2000) == 70 and model.left(150, 2000) == 1  # the prior
    assert model.left(0, 40) == 40  # never past the cap
    rng = random.Random(3)
    lengths = [rng.choice((5, 20, 300, 800)) for _ in range(400)]
    for n in lengths:
        model.observe(n)
    for written, cap in ((0, 2000), (0, 500), (10, 2000), (400, 2000), (400, 600)):
        longer = [min(n, cap) for n in lengths if n > written]
        assert model.left(written, cap) == pytest.approx(sum(longer) / len(longer) - written, abs=1)
    assert model.left(900, 2000) == 225  # past every answer seen: a quarter more of what it wrote
    assert OutputLengthModel(learn=False).left(30, 2000) == 1970  # the oracle's rule: the cap is the length


def test_the_output_length_window_forgets_old_answers():
    model = OutputLengthModel(window=64, min_samples=16)
    for n in [1000] * 64 + [10] * 64:
        model.observe(n)
    assert model.left(0, 2000) == 10
