"""Prompt texts the benches share (``slots.py``, ``spec_vs_plain.py``): the same code, so
figures from both benches describe the same copy workloads."""

from __future__ import annotations

#: A small Python function, for "copy this" and "copy and rename" requests.
MERGE_INTERVALS = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''


def chat_turn(user: str, answer_start: str = "") -> str:
    """One user turn in Gemma's chat template, the model's answer begun with
    ``answer_start`` (tokenize with ``parse_special``: the markers are the template's)."""
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n{answer_start}"
