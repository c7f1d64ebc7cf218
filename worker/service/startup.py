"""Worker start-up before any job: pin the device, fit (or check) the context, load, reserve.

Kept apart from the serving loop (``loop.py``) because it is the part that decides what a
worker *can* do (its capacity); the loop only decides what it does next. Start-up order
matters: the device is pinned (``CUDA_VISIBLE_DEVICES``) before llama.cpp loads, and checkpoint
memory is reserved before any request can take the headroom.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.protocol import FitReport
from shared.settings import Settings
from worker.engine.config import embedding_spec
from worker.engine.embedding import Embedder
from worker.engine.engine import SpeculativeEngine
from worker.fitter import fit_worker, reserve_checkpoints
from worker.launch import WorkerOptions


@dataclass(frozen=True)
class LoadedWorker:
    """What start-up loaded: the engine, the embedding context beside it on the same model
    (None: the worker serves no embeddings) and the fit that sized them both."""

    engine: SpeculativeEngine
    embedder: Embedder | None
    fit: FitReport

    def close(self) -> None:
        """Free the embedding context, then the engine (the model they share goes last)."""
        if self.embedder is not None:
            self.embedder.close()
        self.engine.close()


def load_engine(options: WorkerOptions, n_gpu_layers: int, settings: Settings) -> LoadedWorker:
    """One path for every worker: measure, fit the context (or check the fixed ``--ctx``),
    load the engine once (and its embedding context, ``--embeddings``), and reserve its
    checkpoint memory before any request can take the headroom.

    A fixed context is no shortcut: it is refused the same way a fit is (a device that
    cannot be served, a context above training or beyond memory), and its report is the
    same, so ``specfleet fleet`` shows every worker's fit as it was really reserved.
    """
    fit = fit_worker(options.model_path, device=options.device, budget_mib=options.budget_mib,
                     fit_target_mib=options.fit_target_mib, slots=options.slots,
                     capacity=options.capacity, ctx_min=options.ctx_min, n_threads=options.threads,
                     checkpoint=options.checkpoint, n_ctx=options.n_ctx,
                     allow_ctx_above_train=options.allow_ctx_above_train,
                     prefix_cache=options.prefix_cache,
                     prefix_checkpoints=options.prefix_checkpoints,
                     deterministic=options.deterministic, device_verify=options.device_verify,
                     verify_buckets=options.verify_buckets,
                     embedding_tokens=options.embedding_tokens)
    engine = SpeculativeEngine(replace(fit.config, n_gpu_layers=n_gpu_layers,
                                       fail_device_checkpoint=settings.fail_device_checkpoint,
                                       cost_cache=settings.cost_cache()))
    embedder = None
    try:
        spec = embedding_spec(engine.config)
        embedder = Embedder(engine.model, spec) if spec is not None else None
        return LoadedWorker(engine, embedder, reserve_checkpoints(engine, fit))
    except BaseException:
        if embedder is not None:
            embedder.close()
        engine.close()
        raise
