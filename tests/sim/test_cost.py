import pytest

from mooncake.conductor.estimators import DecodeStepModel, PrefillTimeModel
from mooncake.cost import CostModel

COST = CostModel()


def test_prefill_flops_follow_fast25_eq1():
    n, d = 1000, 8192
    assert COST.prefill_flops(n) == pytest.approx(80 * (4 * n * n * d + 22 * n * d * d))
    assert COST.prefill_flops(n, reused_tokens=n) == 0
    # reuse removes the prefix's own work but not the new tokens' attention over it
    assert COST.prefill_flops(2 * n, n) == pytest.approx(80 * (4 * (4 * n * n - n * n) * d + 22 * n * d * d))


def test_times_kv_bytes_and_transfer():
    flops = COST.prefill_flops(8000)
    assert COST.prefill_s(8000) == pytest.approx(flops / (8 * 312e12 * 0.45))
    assert 0.5 < COST.prefill_s(8000) < 2.0  # about a second for 8k tokens of a 70B model on 8 GPUs
    assert COST.kv_bytes(512) == 512 * 320 * 1024
    assert COST.transfer_s(100e9) == pytest.approx(1.0)  # 4 x 200 Gbps = 100 GB/s
    assert COST.decode_step_s(0, 0) == 0.0
    step = COST.decode_step_s(32, 32 * 12000)
    assert 0.015 < step < 0.06 and COST.decode_step_s(64, 64 * 12000) > step


def test_coefficients_seed_the_conductor_models_exactly():
    prefill = PrefillTimeModel(*COST.prefill_coefficients())
    decode = DecodeStepModel(*COST.decode_coefficients())
    for n, r in [(512, 0), (12000, 3072), (100000, 99000)]:
        assert prefill.predict(n, r) == pytest.approx(COST.prefill_s(n, r))
    assert decode.predict(16, 200000) == pytest.approx(COST.decode_step_s(16, 200000))
