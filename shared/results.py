"""A job's outcome as clients read it: what its final event says, in the shape the CLI's
``--json`` prints and the Python client returns. A leaf beside the protocol, so the client,
the OpenAI replies and the CLI read one definition without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.protocol import FinalEvent, JobStatus, Telemetry, TokenLogprob


@dataclass
class JobResult:
    """A job's outcome, from its final event (the CLI's ``--json`` object)."""

    job_id: str
    status: JobStatus
    tokens: list[int]
    text: str
    telemetry: Telemetry | None
    worker: str | None
    attempts: int
    finish_reason: str | None = None
    error: str | None = None
    #: The sampling seed the job ran with: the same request with it gives the same tokens.
    seed: int | None = None
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def from_final(cls, final: FinalEvent) -> JobResult:
        """The result a job's final event describes (its attempt number is the attempts)."""
        return cls(job_id=final.job_id, status=final.status, tokens=final.tokens,
                   text=final.text, telemetry=final.telemetry, worker=final.worker,
                   attempts=final.attempt,
                   finish_reason=str(final.finish_reason) if final.finish_reason else None,
                   error=final.error, seed=final.seed, logprobs=final.logprobs)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "job_id": self.job_id, "status": str(self.status), "tokens": self.tokens,
            "text": self.text, "telemetry": self.telemetry.model_dump() if self.telemetry else None,
            "worker": self.worker, "attempts": self.attempts,
            "finish_reason": self.finish_reason, "error": self.error, "seed": self.seed}
        if self.logprobs is not None:
            body["logprobs"] = [lp.model_dump(mode="json") for lp in self.logprobs]
        return body
