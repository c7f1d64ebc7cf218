"""Sampling over the fleet: the seed is fixed at submit (so a re-run repeats the tokens) and
reported back; logprobs travel on the token events and in the final event."""

from __future__ import annotations

from helpers import close_floats
from rq.job import Job
from rq.serializers import JSONSerializer

from coordinator.client import Coordinator
from shared.protocol import FinalEvent, JobStatus, ProgressEvent, TokenEvent
from shared.settings import Settings

from .workers import MODEL_NAME, Fleet

SAMPLED = {"model": MODEL_NAME, "prompt_tokens": [3, 1, 4, 1, 5], "max_tokens": 24,
           "sampling": {"temperature": 0.9, "top_p": 0.95}}


def test_a_request_without_a_seed_is_queued_with_one(settings: Settings) -> None:
    """No worker needed: the job on the queue already holds the seed it will run with, so a
    crashed worker's re-run samples the same tokens."""
    coordinator = Coordinator(settings.model_copy(update={"require_live_worker": False}))
    coordinator.connection.sadd(settings.keys.models(), MODEL_NAME)
    drawn = coordinator.submit(SAMPLED)
    own = coordinator.submit({**SAMPLED, "sampling": {"temperature": 0.9, "seed": 77}})
    queued = [Job.fetch(h.job_id, connection=coordinator.connection,
                        serializer=JSONSerializer).args[0]["sampling"] for h in (drawn, own)]
    assert isinstance(queued[0]["seed"], int) and queued[0]["temperature"] == 0.9
    assert queued[1] == {"temperature": 0.9, "seed": 77}


def test_logprobs_and_the_seed_come_back_and_the_seed_repeats_the_run(
        fleet: Fleet, coordinator: Coordinator) -> None:
    fleet.start("w1", extra_env={"SPECFLEET_TOKEN_CHUNK": "3"})
    request = {**SAMPLED, "logprobs": True, "top_logprobs": 3}
    handle = coordinator.submit(request)
    events = list(handle.stream(timeout=60))
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.status is JobStatus.FINISHED
    assert isinstance(final.seed, int) and final.logprobs is not None
    assert [lp.token for lp in final.logprobs] == final.tokens
    assert all(len(lp.top_logprobs) == 3 and lp.logprob <= 0 for lp in final.logprobs)
    streamed = [lp for e in events if isinstance(e, TokenEvent) for lp in e.logprobs or []]
    assert streamed == final.logprobs
    again = coordinator.submit({**request, "sampling": {**SAMPLED["sampling"],  # type: ignore[dict-item]
                                                        "seed": final.seed}}).result(timeout=60)
    assert again.seed == final.seed and again.tokens == final.tokens
    assert close_floats(again.logprobs) == close_floats(final.logprobs)
    plain = coordinator.submit(SAMPLED).result(timeout=60)
    assert plain.logprobs is None and isinstance(plain.seed, int)


def test_a_sampled_job_re_run_after_kill_9_repeats_its_tokens(
        fleet: Fleet, coordinator: Coordinator) -> None:
    """The seed drawn at submit travels with the job: attempt 2 on another worker continues
    the same text, so a reader replaying both attempts sees it once."""
    fleet.start("w0", step_delay=0.04, wait=False)
    fleet.start("w1", step_delay=0.04)
    fleet.wait_registered("w0")
    handle = coordinator.submit({**SAMPLED, "max_tokens": 40})
    events = handle.stream(timeout=60)
    fleet.kill_runner(events)  # once the first tokens of attempt 1 are out
    rest = list(events)
    final = rest[-1]
    assert isinstance(final, FinalEvent) and final.status is JobStatus.FINISHED
    assert final.attempt == 2
    assert any(isinstance(e, ProgressEvent) and e.stage == "requeued" for e in rest)
    first_attempt = [t for e in coordinator.handle(handle.job_id).stream(timeout=5)
                     if isinstance(e, TokenEvent) and e.attempt == 1 for t in e.tokens]
    assert first_attempt and final.tokens[:len(first_attempt)] == first_attempt
    assert "".join(coordinator.handle(handle.job_id).text_stream(timeout=5)) == final.text
    direct = coordinator.submit({**SAMPLED, "max_tokens": 40,
                                 "sampling": {**SAMPLED["sampling"],  # type: ignore[dict-item]
                                              "seed": final.seed}}).result(timeout=60)
    assert direct.tokens == final.tokens
