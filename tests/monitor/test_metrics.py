"""A live worker's ``/metrics`` equals the per-job telemetry of the same run, summed.

The run (see conftest) has replays (MTP, D=1 < N=5) and a forced device-checkpoint failure, so
the replay, checkpoint and fallback counters are all non-zero and all checked.
"""

from __future__ import annotations

from .conftest import PROMPTS, LiveRun
from .scrape import by_label, total

P = "specfleet:"


def _sum(run: LiveRun, field: str) -> int:
    return sum(getattr(t, field) for t in run.telemetries())


def _positions(run: LiveRun, field: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in run.telemetries():
        for i, n in enumerate(getattr(t, field)):
            out[str(i)] = out.get(str(i), 0.0) + n
    return out


def test_speculation_counters_equal_the_summed_job_telemetry(live_run: LiveRun) -> None:
    text = live_run.metrics_text
    assert len(live_run.telemetries()) == len(PROMPTS)
    for metric, field in [("spec_decode_num_drafts", "drafts"),
                          ("spec_decode_num_draft_tokens", "drafted"),
                          ("spec_decode_num_accepted_tokens", "accepted"),
                          ("spec_decode_num_verifies", "target_decodes"),
                          ("generated_tokens", "generated_tokens"),
                          ("prompt_tokens", "prompt_tokens"),
                          ("replay_events", "replay_events"),
                          ("replay_tokens", "replay_tokens"),
                          ("checkpoint_saves", "checkpoint_saves")]:
        assert total(text, f"{P}{metric}_total", method="mtp") == _sum(live_run, field), metric
    assert _sum(live_run, "replay_events") > 0, "no replay happened: the run tests nothing"
    assert _sum(live_run, "drafts") > 0
    # Per position, vLLM-style; position 0 of the drafted counts is every draft.
    assert by_label(text, f"{P}spec_decode_num_accepted_tokens_per_pos_total", "position") \
        == _positions(live_run, "accepted_per_position")
    assert by_label(text, f"{P}spec_decode_num_draft_tokens_per_pos_total", "position") \
        == _positions(live_run, "drafted_per_position")


def test_the_forced_checkpoint_failure_is_one_host_fallback_and_host_mode(
        live_run: LiveRun) -> None:
    text = live_run.metrics_text
    fit = live_run.info.fit
    assert fit is not None and fit.details["checkpoint_mode"] == "host"
    # The reservation fell back before any job ran: no job's telemetry has it, the metric does.
    startup = 1
    per_job = _sum(live_run, "host_fallbacks")
    assert total(text, f"{P}checkpoint_host_fallbacks_total") == startup + per_job == 1
    assert fit.details["checkpoint_fallback"] == "fault_injection"
    assert by_label(text, f"{P}checkpoint_host_fallbacks_total", "reason") \
        == {"fault_injection": 1.0}
    # One device, the host of this CPU worker, held the checkpoint: it is the one named.
    assert fit.details["checkpoint_fallback_devices"] == ["cpu"]
    assert by_label(text, f"{P}checkpoint_device_host_fallbacks_total", "checkpoint_device") \
        == {"cpu": 1.0}
    assert all(t.checkpoint_mode == "host" for t in live_run.telemetries())
    assert total(text, f"{P}checkpoint_mode", mode="host") == 1
    assert total(text, f"{P}checkpoint_mode", mode="device") == 0
    reserved = fit.details["checkpoint_reserved_bytes"]
    assert reserved > 0
    assert total(text, f"{P}checkpoint_reservation_bytes", location="host") == reserved


def test_jobs_latencies_and_capacity(live_run: LiveRun) -> None:
    text = live_run.metrics_text
    n = len(PROMPTS)
    assert total(text, f"{P}jobs_total", outcome="finished") == n
    assert total(text, f"{P}jobs_total", outcome="failed") == 0
    assert total(text, f"{P}jobs_total", outcome="rejected") == 1  # the too-long prompt
    assert total(text, f"{P}time_to_first_token_seconds_count") == n
    assert total(text, f"{P}e2e_request_latency_seconds_count") == n
    # One inter-token gap per delivery after the first: at most one per generated token.
    gaps = total(text, f"{P}inter_token_latency_seconds_count")
    assert 0 < gaps < _sum(live_run, "generated_tokens")
    assert total(text, f"{P}fitted_context_tokens") == live_run.info.n_ctx == 512
    assert total(text, f"{P}slots") == 1
    assert total(text, f"{P}busy_slots") == 0
    seconds = total(text, f"{P}generation_seconds_total")
    assert abs(seconds - sum(t.wall_seconds for t in live_run.telemetries())) < 1e-6


def test_the_registration_carries_the_engines_lifetime_telemetry(live_run: LiveRun) -> None:
    lifetime = live_run.info.telemetry
    assert lifetime is not None
    for field in ("drafts", "drafted", "accepted", "target_decodes", "generated_tokens",
                  "replay_events", "replay_tokens", "checkpoint_saves", "host_fallbacks"):
        assert getattr(lifetime, field) == _sum(live_run, field), field
    assert lifetime.accepted_per_position == [int(v) for v in
                                              _positions(live_run, "accepted_per_position")
                                              .values()]
    assert lifetime.mean_acceptance_length == 1 + lifetime.accepted / lifetime.drafts
    assert lifetime.mean_accepted_length == lifetime.accepted / lifetime.drafts
