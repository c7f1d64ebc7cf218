"""How each committed token was produced (``SlotUpdate.origin``, streamed as
``TokenEvent.origin`` and marked by the console's playground), from a real engine: the marks
add up to the generation's own telemetry."""

from __future__ import annotations

from pathlib import Path

from engine.schedule import Arrival, run_schedule

from shared.constraint import Constraint, ConstraintKind
from shared.protocol import SpecMethod, SpecSettings
from worker.engine.engine import EngineConfig, GenerationResult, SpeculativeEngine
from worker.engine.proposers.none import NoDraft
from worker.engine.slot import Slot, SlotRequest, SlotUpdate
from worker.launch import EngineCapacity
from worker.testmodels import write_dense_llama


def _origins(engine: SpeculativeEngine, request: SlotRequest) -> tuple[str, GenerationResult]:
    """The origin letters of every verified delivery of ``request``, in order, and how it
    ended."""
    marks: list[str] = []

    def on_step(_: int, updates: list[SlotUpdate], __: dict[int, Slot]) -> None:
        for update in updates:
            if update.verified:
                assert len(update.origin) == len(update.tokens)
                marks.append(update.origin)
    [result] = run_schedule(engine, [Arrival(0, request)], on_step).results
    return "".join(marks), result


def test_forced_drafted_and_target_tokens(tmp_path: Path) -> None:
    model = write_dense_llama(tmp_path / "dense-bytes.gguf", byte_vocab=True)
    capacity = EngineCapacity(method=SpecMethod.NGRAM, draft_max=8)
    config = EngineConfig(str(model), n_ctx=512, n_threads=1, capacity=capacity,
                          row_budget=False)
    with SpeculativeEngine(config) as engine:
        # Jump-forward: two forced runs around one free character, nothing drafted.
        grammar = Constraint(kind=ConstraintKind.LARK, grammar='start: "abcdef" /[0-9]/ "ghijk"')
        prompt = engine.tokenize("code: ")
        forced, jump = _origins(engine, SlotRequest(
            prompt, 32, SpecSettings(method=SpecMethod.NGRAM), constraint=grammar,
            prefix_cache=False, proposer=NoDraft()))
        # Prompt lookup on a repetitive prompt: drafts accepted, each verify's own token.
        origin, result = _origins(engine, SlotRequest(
            engine.tokenize("one two three four " * 6), 48,
            SpecSettings(method=SpecMethod.NGRAM), prefix_cache=False))
    assert forced == "ffffff" + "t" + "fffff" and len(jump.tokens) == 12
    assert forced.count("f") == jump.telemetry.forced_tokens
    t = result.telemetry
    assert len(origin) == t.generated_tokens == len(result.tokens)
    assert set(origin) <= {"d", "t"} and origin.count("d") > 0
    # each verify adds at most one token of its own; each "d" was a draft it accepted
    assert origin.count("t") <= t.target_decodes and origin.count("d") <= t.accepted
