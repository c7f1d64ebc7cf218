"""The speculative decoding engine: drafters, verify loop, rollback, width policy, telemetry.

NOTE FOR THE ENGINE ENGINEER (the lead's brief lost two placeholders): the full text of issue 3 is in
/tmp/issue3.md (also `issues show 3`), issue 4 in /tmp/issue4.md. The public API contract the other
engineers code against is below; the lead will replace this note with a proper docstring later.

## The engine's public API (contract other engineers code against — implement exactly this)
In worker/engine/engine.py:
```python
@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    n_ctx: int = 4096                # the fitter passes its fitted context here
    n_threads: int = 2
    n_gpu_layers: int = 0            # -1 = all on GPU (CUDA workers)
    spec: SpecSettings = SpecSettings()   # capacity: draft_max = N the contexts are sized for,
                                     # rollback_depth = D (None = N), method (auto/mtp/ngram/none)
    checkpoint: CheckpointMode = CheckpointMode.DEVICE   # compact-rollback storage preference
    fail_device_checkpoint: bool = False                 # fault injection (tests, drills)

@dataclass
class GenerationResult:
    tokens: list[int]; text: str; finish_reason: FinishReason; telemetry: Telemetry

class SpeculativeEngine:
    def __init__(self, config: EngineConfig) -> None      # loads model + contexts once (resident)
    model: worker.llm.Model
    def tokenize(self, text: str) -> list[int]
    def detokenize(self, tokens: list[int]) -> str
    def generate(self, prompt_tokens: list[int], max_tokens: int, spec: SpecSettings | None = None, *,
                 temperature: float = 0.0, seed: int = 0, stop: Sequence[str] = (),
                 on_tokens: Callable[[list[int], str], None] | None = None,   # newly committed tokens + their text delta
                 should_stop: Callable[[], bool] | None = None,               # checked once per decode step (cancel)
                 ) -> GenerationResult
    def telemetry(self) -> Telemetry            # cumulative over the engine's life
    def close(self) -> None
```
Per-request `spec` may narrow the engine's capacity (smaller draft_max, method none) but never
exceed it: a larger draft_max is clamped to the engine's N (telemetry.draft_max says what ran).
A prompt longer than the context, or prompt + max_tokens beyond n_ctx, is a clear ValueError
(or finish_reason=context when generation reaches the end of the context).
"""
