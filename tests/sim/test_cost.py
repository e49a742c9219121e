import pytest

from mooncake.conductor.cpp import CppSettings, pipelined_prefill_s
from mooncake.conductor.estimators import DecodeStepModel, PrefillTimeModel
from mooncake.cost import CostModel, pipeline_ends
from mooncake.errors import ModelError

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


def test_the_roofline_charges_a_step_its_larger_bound_and_the_additive_model_the_sum():
    additive = CostModel(step_model="additive")
    # pure steps cost the same under both: decode is memory-bound, a long prefill chunk compute-bound
    assert COST.step_s((), 32, 32 * 12000) == pytest.approx(COST.decode_step_s(32, 32 * 12000))
    assert COST.step_s([(2048, 1024)]) == pytest.approx(COST.prefill_s(2048, 1024))
    assert additive.step_s([(2048, 1024)], 32, 32 * 12000) == pytest.approx(
        COST.prefill_s(2048, 1024) + COST.decode_step_s(32, 32 * 12000))
    mixed = COST.step_s([(2048, 1024)], 32, 32 * 12000)
    assert COST.prefill_s(2048, 1024) < mixed < additive.step_s([(2048, 1024)], 32, 32 * 12000)
    # a short chunk reads the weights like a decode step: it costs at least that read
    assert COST.step_s([(16, 0)]) == pytest.approx(COST.weight_bytes / (COST.hbm_bytes_per_s * 0.6))
    assert COST.step_s((), 0, 0) == 0.0
    with pytest.raises(ModelError, match="step_model"):
        CostModel(step_model="sum")


def test_coefficients_seed_the_conductor_models_exactly():
    prefill = PrefillTimeModel(*COST.prefill_coefficients())
    decode = DecodeStepModel(*COST.decode_coefficients())
    for n, r in [(512, 0), (12000, 3072), (100000, 99000)]:
        assert prefill.predict(n, r) == pytest.approx(COST.prefill_s(n, r))
    assert decode.predict(16, 200000) == pytest.approx(COST.decode_step_s(16, 200000))
    per_row = CostModel(decode_row_s=0.002)  # a core's per-row work: the conductor's per-sequence term
    decode = DecodeStepModel(*per_row.decode_coefficients())
    for batch in (1, 16):
        assert per_row.decode_step_s(batch, 200000) == pytest.approx(COST.decode_step_s(batch, 200000) + 0.002 * batch)
        assert decode.predict(batch, 200000) == pytest.approx(per_row.decode_step_s(batch, 200000))
        assert per_row.step_s((), batch, 200000) == pytest.approx(COST.step_s((), batch, 200000) + 0.002 * batch)


def test_a_pipeline_of_one_stage_sums_its_chunks_and_more_stages_divide_a_long_prompt():
    chunks = [1.0, 2.0, 3.0, 4.0]
    assert pipeline_ends(chunks, 1) == [pytest.approx(10.0)]
    assert pipeline_ends(chunks, 1, free_s=[5.0]) == [pytest.approx(15.0)]
    # two stages: each chunk takes half on each; stage 1 starts a chunk when stage 0 has passed it on
    assert pipeline_ends(chunks, 2) == pytest.approx([5.0, 7.0])
    assert pipeline_ends(chunks, 2, hop_s=0.25) == pytest.approx([5.0, 7.25])
    # a stage still busy with earlier work holds the chunks back
    assert pipeline_ends(chunks, 2, free_s=[0.0, 6.0]) == pytest.approx([5.0, 11.0])
    even = [1.0] * 64
    for x in (2, 4, 8):
        ends = pipeline_ends(even, x)
        assert ends == sorted(ends) and ends[-1] == pytest.approx(64 / x + (x - 1) / x)  # fill, then one per chunk


def test_cpp_settings_chunk_only_long_prompts():
    settings = CppSettings(stages=4, threshold_tokens=2048, chunk_tokens=1000)
    assert settings.chunk_bounds(2048, 0) == [0, 2048]  # at the threshold: one chunk
    assert settings.chunk_bounds(4000, 1500) == [1500, 2500, 3500, 4000]
    whole = COST.prefill_s(131072)
    ends = pipelined_prefill_s(settings, COST.prefill_s, 131072, 0, COST.network_bytes_per_s)
    assert whole / 4 < ends[-1] < whole / 3.5  # 131 chunks over 4 stages: close to 4x
    short = pipelined_prefill_s(settings, COST.prefill_s, 2000, 0, COST.network_bytes_per_s)
    assert short[-1] == pytest.approx(COST.prefill_s(2000) + 3 * settings.hop_s(2000, COST.network_bytes_per_s))
