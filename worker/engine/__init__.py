"""The speculative decoding engine: drafters, verify loop, rollback, width policy, telemetry.

``SpeculativeEngine(EngineConfig(...))`` loads a model once and keeps it resident;
``generate()`` runs one request (see docs/engine.md). Drafters live in ``proposers/`` (one a
module), the rollback policies in ``rollback/``, the draft-width policy and the telemetry
counters in their own modules, so the decode loop stays free of per-feature branches.
"""
