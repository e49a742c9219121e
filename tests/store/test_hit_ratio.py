from pathlib import Path

import pytest

from mooncake.sim.trace import TraceError, load_trace
from mooncake.store.hit_ratio import hit_ratio

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


def test_prefix_semantics_on_a_built_trace():
    requests = [(1, 2, 3), (1, 2, 4), (9, 2, 3)]
    # second request: 1, 2 hit (2 of 3); third: 9 misses, so its cached 2 and 3 do not count.
    assert hit_ratio(requests, capacity_blocks=100) == pytest.approx(2 / 9)
    # capacity 2: inserting 3 evicts 1, so the second request's prefix misses at once.
    assert hit_ratio(requests, capacity_blocks=2) == 0.0


@pytest.mark.skipif(not TRACE.exists(), reason="shared trace not beside the checkout")
def test_lru_on_the_conversation_trace_matches_the_published_ratios():
    requests = [r.hash_ids for r in load_trace(TRACE)]
    assert len(requests) == 12031
    # DESIGN section 9 / traces README: LRU over one pool hits 11.0 / 28.8 / 35.5% at 5k / 20k / 50k.
    for capacity, expected in [(5000, 0.110), (20000, 0.288), (50000, 0.355)]:
        assert hit_ratio(requests, capacity, "lru") == pytest.approx(expected, abs=0.005)


def test_bad_trace_line_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
                    '{"timestamp": 1, "input_length": "x", "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: .*input_length"):
        load_trace(path)
    path.write_text("not json\n")
    with pytest.raises(TraceError, match=r"t.jsonl:1"):
        load_trace(path)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")
