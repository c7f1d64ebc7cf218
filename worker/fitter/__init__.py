"""The fitter: measure what a worker will allocate, fit its context, reserve checkpoints.

Two calls, in this order, at worker start-up (``specfleet fit`` runs the first alone)::

    fit = fit_worker(model_path, device="cuda:0", budget_mib=None, fit_target_mib=1024,
                     slots=1, capacity=EngineCapacity(...), ctx_min=1024)
    engine = SpeculativeEngine(fit.config)        # fit.config.n_ctx is the fitted context
    reserve_checkpoints(engine, fit)              # before taking any request
    publish(fit.report)                           # shared.protocol.FitReport

``fit_worker`` measures weights, KV, recurrent state and snapshots, compute buffers, the MTP
draft context and the checkpoint size from llama.cpp itself, then picks the largest context
(a multiple of 256, at most the training context) whose total stays under free - margin, and
logs one ``fit.report`` event. ``reserve_checkpoints`` allocates the compact-rollback
checkpoint storage and checks it against the measurement. Both raise :class:`FitError`, with
the breakdown in the message, when the worker must not start. See docs/fitter.md.
"""

from worker.fitter.errors import FitError
from worker.fitter.fit import FitResult, fit_worker
from worker.fitter.reserve import reserve_checkpoints

__all__ = [
    "FitError",
    "FitResult",
    "fit_worker",
    "reserve_checkpoints",
]
