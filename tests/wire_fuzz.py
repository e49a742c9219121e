"""Hypothesis strategies for frames a stranger might send a role's control socket: garbage bytes, any
msgpack value, and maps shaped like real messages (a known tag, its field names) with values of any type."""

import msgpack
from hypothesis import strategies as st

from mooncake import messages as m

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)


@st.composite
def wrong_messages(draw) -> bytes:
    """A msgpack map shaped like a real message (a known tag, its field names) with values of any type."""
    tag = draw(st.sampled_from(sorted(m._TYPES)))
    names = list(m._TYPES[tag].__struct_fields__)
    fields = {name: draw(values) for name in draw(st.lists(st.sampled_from(names), unique=True))}
    return msgpack.packb({"t": tag, "v": draw(st.sampled_from([m.VERSION, m.VERSION, 0, "1"])), **fields})


frames = wrong_messages() | st.binary(max_size=64) | st.builds(msgpack.packb, values)
