"""Hypothesis strategies for malformed generation requests (shared by the fuzz tests)."""

from __future__ import annotations

from hypothesis import strategies as st

VALID_FOR_MODEL_M = {"model": "m", "prompt_tokens": [1, 2, 3], "max_tokens": 8}

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8,
)
_FIELDS = ["model", "prompt", "prompt_tokens", "max_tokens", "sampling", "logprobs",
           "top_logprobs", "temperature", "stop", "speculative", "priority", "custom_id",
           "bogus"]


@st.composite
def malformed_requests(draw: st.DrawFn, valid: dict[str, object] = VALID_FOR_MODEL_M) -> object:
    """A valid request with one field broken (wrong type, out of range, unknown, missing),
    or arbitrary JSON where an object was expected."""
    if draw(st.booleans()):
        return draw(_json.filter(lambda v: not isinstance(v, dict)))
    request = dict(valid)
    field = draw(st.sampled_from(_FIELDS))
    broken = draw(st.sampled_from([
        None, -1, 0, 10**9, "", "x" * 300, [], [-5], {}, {"method": "warp"},
        {"draft_max": 0}, {"draft_min": 9, "draft_max": 2}, 3.5, True,
    ]) | _json)
    if field == "prompt_tokens" and broken is None:
        request.pop("prompt_tokens")  # no prompt at all
    else:
        request[field] = broken
    return request
