"""Fit the context to the device: the largest n_ctx whose measured total stays under budget.

The total at a context size is measured, not extrapolated: the engine's target (and MTP
draft) contexts are created at that size over a no_alloc model and llama.cpp's own sizes are
added up, so sliding-window caches, compute buffers that grow with the context and
everything else llama.cpp does are accounted as it does them. Totals grow with the context,
so a binary search over multiples of 256 finds the largest that fits in about
log2(n_ctx_train / 256) measurements of a few milliseconds each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

from shared.protocol import CheckpointMode, DeviceFit, FitReport
from worker.engine.config import EMBEDDING_SEQS, EngineConfig, model_spec
from worker.engine.plan import ModelFacts
from worker.engine.prefix_cache import MemoryKind
from worker.fitter.buffers import HOST, DeviceMap, split
from worker.fitter.devices import (
    MIB,
    DeviceMemory,
    device_map,
    group_memory,
    require_device,
)
from worker.fitter.errors import FitError
from worker.fitter.measure import (
    ContextMemory,
    StateSizes,
    load_model,
    measure_context,
    measure_prefix_checkpoint,
    measure_state,
    weights_bytes,
)
from worker.fitter.report import breakdown_text, log_report, mib
from worker.fitter.specs import EngineSpecs, engine_specs
from worker.launch import (
    AUTO_SLOTS,
    DEFAULT_CHECKPOINTS,
    DEFAULT_CTX_MIN,
    DEFAULT_FIT_TARGET_MIB,
    MAX_SLOTS,
    DeviceGroup,
    DeviceRef,
    EngineCapacity,
    parse_device_group,
)
from worker.llm import LlamaError, Model
from worker.llm.placement import placed

#: Context sizes are fitted in steps of this many tokens.
CTX_STEP = 256
#: Extra context the marginal KV bytes per token are measured over (no_alloc: free).
_KV_PROBE_SPAN = 4096
#: Log lines carry 0.01 MiB: how far llama.cpp's recurrent buffer may sit from the exact sum.
_LOG_RESOLUTION = round(0.01 * MIB)


@dataclass(frozen=True)
class FitResult:
    """What the worker builds its engine with, and the report that justifies it."""

    config: EngineConfig
    report: FitReport

    @property
    def n_ctx(self) -> int:
        return self.report.n_ctx


@dataclass(frozen=True)
class Breakdown:
    """Every component's bytes at one context size, per fitted device, and beside them."""

    #: Components per place: every fitted device, and :data:`HOST` on a GPU worker (host
    #: memory beside the devices: output, host compute, host-side caches).
    per_device: dict[str, dict[str, int]]
    devices: tuple[str, ...]
    #: Output-buffer growth after creation: in the total, not in llama.cpp's load-time logs.
    runtime_growth: int
    #: llama.cpp's recurrent buffer (live + snapshots), the cross-check of the exact sum.
    recurrent_reported: int

    @property
    def components(self) -> dict[str, int]:
        """Each component summed over the fitted devices."""
        summed: Counter[str] = Counter()
        for device in self.devices:
            summed.update(self.per_device[device])
        return {key: summed[key] for key in self.per_device[self.devices[0]]}

    @property
    def total(self) -> int:
        return sum(self.device_total(d) for d in self.devices)

    def device_total(self, device: str) -> int:
        return sum(self.per_device[device].values())

    @property
    def host_bytes(self) -> int:
        """A GPU worker's host-memory buffers (output, host compute, ...): not on a device."""
        return sum(self.per_device.get(HOST, {}).values())


class _Sizer:
    """Measures the engine's memory at any context size; each size is measured once."""

    def __init__(self, config: EngineConfig, where: DeviceMap) -> None:
        self.config = config
        self.where = where
        self.slots = config.slots
        self.model, buffers = load_model(model_spec(config, no_alloc=True))
        #: Model layers per fitted device, as llama.cpp placed them.
        self.layers = buffers.model_layers_by_device(where)
        try:
            self.specs: EngineSpecs = engine_specs(config, ModelFacts.of(self.model))
        except ValueError as exc:  # e.g. MTP asked of a model without a head
            self.model.close()
            raise FitError(str(exc)) from exc
        self._seen: dict[int, Breakdown] = {}
        #: A group's model loaded for real (by :attr:`_real`), and the sizes measured on it.
        self._loaded: Model | None = None
        self._allocated: dict[int, Breakdown] = {}

    def close(self) -> None:
        self.model.close()
        if self._loaded is not None:
            self._loaded.close()

    @property
    def n_ctx_cap(self) -> int:
        return self.model.n_ctx_train // CTX_STEP * CTX_STEP

    @property
    def group(self) -> bool:
        """The model spans several fitted devices (the host of a CPU worker is one)."""
        return len(self.where.devices) > 1

    @cached_property
    def _real(self) -> tuple[dict[str, int], StateSizes | None, int]:
        """Weights per place, exact state sizes and one prefix checkpoint's bytes. The states
        need a real load (memory-mapped, on the CPU), and so do a CPU worker's weights and a
        group's (only a real load on the group says what each device holds); one GPU's
        weights come from the no_alloc load."""
        on_gpu = self.where.host == HOST
        gpu_weights = (weights_bytes(self.model, None, self.where)
                       if on_gpu and not self.group else {})
        prefix = (self.config.prefix_cache and self.config.prefix_checkpoints > 0
                  and MemoryKind.of(self.model, self.specs.target.swa_full).checkpoints)
        if gpu_weights and not self.model.is_recurrent and not prefix:
            return gpu_weights, None, 0
        spec = model_spec(self.config)
        real, buffers = load_model(spec if self.group else replace(spec, n_gpu_layers=0))
        try:
            weights = gpu_weights or weights_bytes(real, buffers, self.where)
            state = measure_state(real, self.specs.target) if real.is_recurrent else None
            checkpoint = measure_prefix_checkpoint(real, self.specs.target) if prefix else 0
        finally:
            if self.group:  # kept for :meth:`allocated`, closed with the sizer
                self._loaded = real
            else:
                real.close()
        return weights, state, checkpoint

    @property
    def weights(self) -> dict[str, int]:
        return self._real[0]

    @property
    def state(self) -> StateSizes | None:
        return self._real[1]

    @property
    def prefix_checkpoint(self) -> int:
        """One prefix checkpoint's bytes (0: the model needs none, or reuse is off)."""
        return self._real[2]

    @property
    def prefix_checkpoints(self) -> int:
        """Every slot's prefix-checkpoint buffers (host memory: a CPU worker's device)."""
        return self.slots * self.config.prefix_checkpoints * self.prefix_checkpoint

    @property
    def lookup_cache(self) -> int:
        """The suffix drafter's output-cache bound (host memory: a CPU worker's device)."""
        return self.config.lookup_cache_bytes if self.specs.plan.suffix else 0

    def checkpoint_per_slot(self, recurrent_layers: Counter[str]) -> dict[str, int]:
        """Bytes one slot's checkpoint occupies per place (none when no checkpoint is
        needed): a device checkpoint where the recurrent layers are, a host one on the host
        of a CPU worker (beside a GPU it is host memory the reservation reports)."""
        mode = self.specs.plan.checkpoint
        if mode is None or self.state is None:
            return {}
        if mode is CheckpointMode.DEVICE:
            return split(self.state.group, recurrent_layers)
        host = self.where.host
        return {host: self.state.host_checkpoint} if host != HOST else {}

    def target(self, n_ctx: int, n_rs_seq: int | None = None,
               model: Model | None = None) -> ContextMemory:
        specs = self.specs.at(n_ctx)
        spec = specs.target if n_rs_seq is None else specs.target.with_(n_rs_seq=n_rs_seq)
        # Every slot verifies draft_max + 1 rows in the same decode; an MTP target hands over a
        # hidden row for every batch entry.
        hidden = spec.n_batch if specs.draft is not None else 0
        return measure_context(model or self.model, spec, self.where,
                               self.slots * (specs.plan.draft_max + 1), hidden)

    def at(self, n_ctx: int) -> Breakdown:
        """Every component's bytes per device at ``n_ctx`` (see docs/fitter.md)."""
        if n_ctx not in self._seen:
            self._seen[n_ctx] = self._measure(n_ctx)
        return self._seen[n_ctx]

    def allocated(self, n_ctx: int) -> Breakdown:
        """Every component at ``n_ctx`` as the engine will allocate it. Over a group the
        contexts are created for real over the model loaded on the group: llama.cpp's no_alloc
        compute estimate there is not its allocation (its size-only reservation resets the
        scheduler after the graph is built, dropping the device llama.cpp pins each layer's
        ``norm`` to, so the estimate splits the graph elsewhere: docs/fitter.md, "Device
        groups"). On one device the estimate is the allocation. Raises FitError when the
        group cannot allocate the contexts."""
        if not self.group:
            return self.at(n_ctx)
        if n_ctx not in self._allocated:
            self._real  # noqa: B018  (loads the group's model)
            self._allocated[n_ctx] = self._measure(n_ctx, self._loaded)
        return self._allocated[n_ctx]

    @cached_property
    def step_growth(self) -> dict[str, int]:
        """Each device's growth over one context step, estimated at the smallest sizes."""
        lo, hi = self.at(CTX_STEP), self.at(min(2 * CTX_STEP, self.n_ctx_cap))
        return {d: hi.device_total(d) - lo.device_total(d) for d in self.where.devices}

    @cached_property
    def embedding(self) -> ContextMemory | None:
        """The embedding context (the same at every target size), or None: every row of an
        embedding decode is an output row."""
        spec = self.specs.embedding
        return (measure_context(self.model, spec, self.where, spec.n_batch)
                if spec is not None else None)

    def _measure(self, n_ctx: int, model: Model | None = None) -> Breakdown:
        """The breakdown at ``n_ctx`` from contexts over ``model`` (default: the no_alloc
        one, whose contexts allocate nothing)."""
        target = self.target(n_ctx, model=model)
        draft_spec = self.specs.at(n_ctx).draft
        draft = (measure_context(model or self.model, draft_spec, self.where, self.slots,
                                 self.slots) if draft_spec is not None else None)
        group = self.state.group if self.state else 0
        live = self.slots * group
        snapshots = self.slots * self.specs.plan.n_rs_seq * group
        self._check_recurrent(target.recurrent_total, live + snapshots, n_ctx)
        layers = target.recurrent_layers
        live_at, snapshots_at = split(live, layers), split(snapshots, layers)
        checkpoints = self.checkpoint_per_slot(layers)
        host = self.where.host
        embedding = self.embedding
        parts = [p for p in (target, draft, embedding) if p is not None]

        def on(place: str) -> dict[str, int]:
            at_host = place == host
            return {
                "weights": self.weights.get(place, 0),
                "kv": target.kv[place],
                "recurrent": live_at.get(place, 0),
                "snapshots": snapshots_at.get(place, 0),
                "compute": target.compute[place],
                "output": target.output_runtime if at_host else 0,
                "draft": (draft.kv[place] + draft.recurrent[place] + draft.compute[place]
                          + (draft.output_runtime if at_host else 0)) if draft else 0,
                "checkpoint_reservation": self.slots * checkpoints.get(place, 0),
                "lookup_cache": self.lookup_cache if at_host else 0,
                "prefix_checkpoints": self.prefix_checkpoints if at_host else 0,
                "embeddings": (embedding.kv[place] + embedding.compute[place]
                               + (embedding.output_runtime if at_host else 0)
                               ) if embedding else 0,
            }

        return Breakdown(
            per_device={place: on(place) for place in self.where.places},
            devices=self.where.devices,
            # Growth of host memory: part of the fitted total only where the host is a device.
            runtime_growth=(sum(max(0, p.output_runtime - p.output_created) for p in parts)
                            if host != HOST else 0),
            recurrent_reported=target.recurrent_total,
        )

    def _check_recurrent(self, reported: int, exact: int, n_ctx: int) -> None:
        """llama.cpp's recurrent buffer must be the exact groups we account, within its log
        resolution (per buffer: a group's devices each log their own): otherwise the layout
        is not what the fit assumes, and fitting is unsafe."""
        tolerance = _LOG_RESOLUTION * len(self.where.places) + exact // 100
        if abs(reported - exact) > tolerance:
            raise FitError(
                f"recurrent memory mismatch at n_ctx={n_ctx}: llama.cpp reports "
                f"{mib(reported)} MiB, {self.slots} slot(s) x (1 + {self.specs.plan.n_rs_seq}) "
                f"groups of {self.state.group if self.state else 0} B give {mib(exact)} MiB"
            )


def fit_worker(model_path: str, device: str | DeviceRef | DeviceGroup = "cpu",
               budget_mib: float | Sequence[float] | None = None,
               fit_target_mib: float | Sequence[float] = DEFAULT_FIT_TARGET_MIB,
               slots: int | Literal["auto"] = 1, capacity: EngineCapacity | None = None,
               ctx_min: int = DEFAULT_CTX_MIN,
               n_threads: int = 2,
               checkpoint: CheckpointMode = CheckpointMode.DEVICE,
               n_ctx: int | None = None, allow_ctx_above_train: bool = False,
               prefix_cache: bool = True,
               prefix_checkpoints: int = DEFAULT_CHECKPOINTS,
               deterministic: bool = False, device_verify: bool | None = None,
               verify_buckets: bool | None = None, embedding_tokens: int = 0) -> FitResult:
    """Measure the model on ``device`` and fit the largest context that leaves the margin.

    ``device`` is ``cpu``, ``cuda:N`` or a device group (:class:`~worker.launch.DeviceGroup`:
    ``--device`` list, ``--rpc``, split options); ``budget_mib`` and ``fit_target_mib`` are
    one figure for every device or one per device in the group's order. Every device must
    keep its margin: the context is the largest at which none exceeds its own budget, and a
    refusal names the device that does not fit and by how much (docs/fitter.md, "Device
    groups"). Models loaded inside the call are placed on the group; an engine built from
    the result must be loaded under the same placement (``worker.llm.placement.placed``).

    With ``n_ctx`` (a worker's ``--ctx``) the context is not searched but checked the same
    way: against the training context (above it only with ``allow_ctx_above_train``) and
    against the memory measured at that size, so a fixed context gets the same refusal, the
    same report and the same reservation as a fitted one.

    Raises :class:`FitError` (with the breakdown) when nothing safe fits: the device cannot
    be used, the weights alone or the context (``ctx_min``, or ``n_ctx``) exceed
    ``free - margin``.

    ``slots`` sequences share the worker's context, each with the fitted ``n_ctx`` (the
    report's per-slot context); ``"auto"`` picks the most slots that still fit ``ctx_min``
    each (:func:`_most_slots`). ``capacity`` is what the engine is loaded for (method, N, D:
    they size every context measured); the returned ``config`` keeps the default
    ``request_defaults``, which size nothing. ``prefix_cache`` and ``prefix_checkpoints``
    (per slot) size the prefix checkpoints of a sliding-window or recurrent model;
    ``deterministic`` measures the layout of deterministic mode (no repacked weights, a full
    sliding-window cache); ``device_verify`` the target with its sequences sampled on the
    device (None: where the layers are on a GPU); ``verify_buckets`` is carried into the
    config (pad rows stay within a verify's rows: nothing more to measure; refused with
    compact rollback); ``embedding_tokens`` the embedding context
    (``EngineConfig.embedding_tokens``; 0: none), at most the training context.
    """
    if slots != AUTO_SLOTS and not (isinstance(slots, int) and 1 <= slots <= MAX_SLOTS):
        raise FitError(f"slots must be at least 1 and at most {MAX_SLOTS} (or 'auto'), "
                       f"got {slots!r}")
    group = _group(device)
    budgets_mib = _per_device("--budget-mib", budget_mib, group)
    targets_mib = _per_device("--fit-target-mib", fit_target_mib, group)
    if any(t is None or t < 0 for t in targets_mib):
        raise FitError(f"--fit-target-mib must not be negative, got {fit_target_mib}")
    require_device(group)
    config = EngineConfig(model_path=model_path, n_threads=n_threads,
                          n_gpu_layers=-1 if group.offload else 0,
                          capacity=capacity or EngineCapacity(), checkpoint=checkpoint,
                          prefix_cache=prefix_cache, prefix_checkpoints=prefix_checkpoints,
                          deterministic=deterministic, device_verify=device_verify,
                          verify_buckets=verify_buckets, embedding_tokens=embedding_tokens)
    try:
        with placed(group) as placement:
            where = device_map(group, placement)
            budget = _Budgets(tuple(
                _Budget(memory, round(float(target or 0) * MIB))
                for memory, target in zip(group_memory(group, placement, budgets_mib),
                                          targets_mib, strict=True)))
            if slots == AUTO_SLOTS:
                # A fixed context is what every slot must hold; otherwise at least --ctx-min.
                slots = _most_slots(config, where, n_ctx or ctx_min, budget)
            config = replace(config, slots=slots)
            sizer = _Sizer(config, where)
            try:
                _check_embedding(sizer)
                source = "fitted" if n_ctx is None else "fixed"
                if n_ctx is None:
                    n_ctx = _search(sizer, ctx_min, budget)
                else:
                    _check_fixed(sizer, n_ctx, allow_ctx_above_train, budget)
                report = _report(sizer, n_ctx, budget, source, group)
            finally:
                sizer.close()
    except LlamaError as exc:  # a device of the group cannot be used (unreachable, absent)
        raise FitError(str(exc)) from exc
    log_report(report)
    return FitResult(replace(config, n_ctx=n_ctx), report)


def _group(device: str | DeviceRef | DeviceGroup) -> DeviceGroup:
    if isinstance(device, DeviceGroup):
        return device
    if isinstance(device, DeviceRef):
        return DeviceGroup.of(device)
    try:
        return parse_device_group(device)
    except ValueError as exc:
        raise FitError(str(exc)) from exc


def _per_device(flag: str, value: float | Sequence[float] | None,
                group: DeviceGroup) -> list[float | None]:
    """One figure for every device of ``group``, or one per device, as a list in its order."""
    if value is None or isinstance(value, int | float):
        return [value] * len(group.devices)
    if len(value) != len(group.devices):
        raise FitError(f"{flag} has {len(value)} values for {len(group.devices)} devices "
                       f"({group.name}): give one, or one per device")
    return list(value)


@dataclass(frozen=True)
class _Budget:
    """What the fit may use on one device: its free memory less the operator's margin."""

    memory: DeviceMemory
    margin: int

    @property
    def available(self) -> int:
        return self.memory.free_bytes - self.margin

    @property
    def where(self) -> str:
        m = self.memory
        return (f"{mib(self.available)} MiB available on {m.device} "
                f"({m.source}: free {mib(m.free_bytes)} MiB - margin {mib(self.margin)} MiB)")

    def require_room(self) -> None:
        """A margin that leaves nothing is named as such (not as a negative "available")."""
        if self.available <= 0:
            raise FitError(
                f"nothing can fit on {self.memory.device}: the margin left free "
                f"(--fit-target-mib, default {DEFAULT_FIT_TARGET_MIB:.0f}) is "
                f"{mib(self.margin)} MiB of the {mib(self.memory.free_bytes)} MiB free "
                f"({self.memory.source}); lower --fit-target-mib (0 uses all of it)")


@dataclass(frozen=True)
class _Budgets:
    """Every fitted device's budget, in the model's device order: a size fits when no device
    exceeds its own."""

    each: tuple[_Budget, ...]

    @property
    def available(self) -> int:
        return sum(b.available for b in self.each)

    @property
    def group(self) -> bool:
        return len(self.each) > 1

    @property
    def source(self) -> str:
        """Where the figures came from: one source, or one per device."""
        sources = [b.memory.source for b in self.each]
        return sources[0] if len(set(sources)) == 1 else ",".join(sources)

    def fits(self, breakdown: Breakdown) -> bool:
        return all(breakdown.device_total(b.memory.device) <= b.available for b in self.each)

    def within_a_step(self, breakdown: Breakdown, step: dict[str, int]) -> bool:
        """Whether every device's total, less one context step's growth there, is within its
        budget: close enough to fitting to be worth allocating for real."""
        return all(breakdown.device_total(b.memory.device) - step.get(b.memory.device, 0)
                   <= b.available for b in self.each)

    def require_weights(self, weights: dict[str, int]) -> None:
        """The first comparison every fit makes: every device's margin leaves room, then
        every device holds its share of the weights."""
        for budget in self.each:
            budget.require_room()
        for budget in self.each:
            held = weights.get(budget.memory.device, 0)
            if held <= budget.available:
                continue
            if not self.group:
                raise FitError(f"the weights do not fit: {mib(held)} MiB of weights, "
                               f"{budget.where}")
            raise FitError(f"the weights do not fit on {budget.memory.device}: {mib(held)} MiB "
                           f"of weights there, {budget.where}: "
                           f"{mib(held - budget.available)} MiB short")

    def refuse(self, what: str, breakdown: Breakdown) -> None:
        """Raise for the first device ``breakdown`` does not fit: ``what`` does not fit, with
        what that device needs, has, lacks and holds."""
        for budget in self.each:
            device = budget.memory.device
            need = breakdown.device_total(device)
            if need <= budget.available:
                continue
            if not self.group:
                raise FitError(f"{what} does not fit: needs {mib(need)} MiB, {budget.where}; "
                               f"breakdown: {breakdown_text(breakdown.components)}")
            raise FitError(f"{what} does not fit on {device}: needs {mib(need)} MiB there, "
                           f"{budget.where}: {mib(need - budget.available)} MiB short; "
                           f"breakdown there: {breakdown_text(breakdown.per_device[device])}")


def _search(sizer: _Sizer, ctx_min: int, budget: _Budgets) -> int:
    """The largest multiple of 256 up to n_ctx_train whose total fits every device's
    free - margin."""
    lo = -(-max(ctx_min, 1) // CTX_STEP)
    if lo * CTX_STEP > sizer.n_ctx_cap:
        raise FitError(f"--ctx-min {ctx_min} exceeds the model's training context "
                       f"({sizer.model.n_ctx_train} tokens, fitted in steps of {CTX_STEP})")
    budget.require_weights(sizer.weights)
    floor = lo * CTX_STEP
    budget.refuse(f"context {floor} (--ctx-min {ctx_min})",
                  _allocation(sizer, floor, budget) or sizer.at(floor))
    hi = sizer.n_ctx_cap // CTX_STEP
    while lo < hi:  # invariant: lo fits and the answer lies in [lo, hi]
        mid = (lo + hi + 1) // 2
        if budget.fits(sizer.at(mid * CTX_STEP)):
            lo = mid
        else:
            hi = mid - 1
    return _settle(sizer, lo * CTX_STEP, floor, budget)


def _settle(sizer: _Sizer, n_ctx: int, floor: int, budget: _Budgets) -> int:
    """The size the estimates found, moved onto what the engine will allocate (a group's
    estimate is not its allocation: :meth:`_Sizer.allocated`): down while it does not fit,
    then up while the next step does. The search's estimates are off by a few split inputs
    at most, so this is a step or two of real contexts."""
    if not sizer.group:
        return n_ctx
    while n_ctx > floor and not _fits(sizer, n_ctx, budget):
        n_ctx -= CTX_STEP
    while n_ctx < sizer.n_ctx_cap and _fits(sizer, n_ctx + CTX_STEP, budget):
        n_ctx += CTX_STEP
    return n_ctx


def _allocation(sizer: _Sizer, n_ctx: int, budget: _Budgets) -> Breakdown | None:
    """:meth:`_Sizer.allocated`, or None where it is not measured: the estimate is more than
    a step beyond some device's budget (a real context far past the budgets could take memory
    that is not there; the estimate decides such a size), or the group cannot allocate it."""
    if not sizer.group:
        return sizer.at(n_ctx)  # one device: the estimate is the allocation
    if not budget.within_a_step(sizer.at(n_ctx), sizer.step_growth):
        return None
    try:
        return sizer.allocated(n_ctx)
    except FitError:
        return None


def _fits(sizer: _Sizer, n_ctx: int, budget: _Budgets) -> bool:
    """Whether ``n_ctx`` fits every device as the engine will allocate it; a size the group
    cannot allocate does not fit, whatever its budgets say."""
    found = _allocation(sizer, n_ctx, budget)
    return found is not None and budget.fits(found)


def _most_slots(config: EngineConfig, where: DeviceMap, ctx_min: int, budget: _Budgets) -> int:
    """The largest slot count whose engine still fits with ``ctx_min`` tokens per slot.

    Memory grows with the slot count (KV, recurrent groups, checkpoints, verify rows), so
    doubling finds a bound and a binary search the answer, each probe one measurement at
    ``ctx_min``. One slot that does not fit is left to the normal search, which names why.
    """
    n_ctx = -(-max(ctx_min, 1) // CTX_STEP) * CTX_STEP

    def fits(slots: int) -> bool:
        sizer = _Sizer(replace(config, slots=slots), where)
        try:
            return n_ctx <= sizer.n_ctx_cap and _fits(sizer, n_ctx, budget)
        finally:
            sizer.close()

    if not fits(1):
        return 1
    lo, hi = 1, 2
    while hi <= MAX_SLOTS and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_SLOTS + 1)
    while hi - lo > 1:  # invariant: lo fits, hi does not (or is past the maximum)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _check_fixed(sizer: _Sizer, n_ctx: int, allow_above_train: bool, budget: _Budgets) -> None:
    """Refuse a fixed context the model was not trained for, or that the memory cannot hold.

    Above the training context the total is first bounded from below by the total at the
    training context plus the marginal KV bytes per token for the rest: a context far beyond
    memory (``--ctx 1000000000``) is refused from two small measurements, without ever
    asking llama.cpp for a context of that size. Over a group the bound is checked against
    the group's memory together (a necessary condition); each device is checked at the size.
    """
    train = sizer.model.n_ctx_train
    if n_ctx > train and not allow_above_train:
        raise FitError(f"--ctx {n_ctx} exceeds the model's training context ({train} tokens); "
                       "pass --allow-ctx-above-train to run beyond it anyway")
    budget.require_weights(sizer.weights)
    if n_ctx > sizer.n_ctx_cap:
        at_cap = sizer.at(sizer.n_ctx_cap)
        per_token = _kv_bytes_per_token(sizer, sizer.n_ctx_cap)
        floor = at_cap.total + round(per_token * (n_ctx - sizer.n_ctx_cap))
        if floor > budget.available:
            where = (budget.each[0].where if not budget.group else
                     f"{mib(budget.available)} MiB available on "
                     f"{', '.join(b.memory.device for b in budget.each)} together")
            raise FitError(
                f"--ctx {n_ctx} does not fit: needs at least {mib(floor)} MiB "
                f"({mib(at_cap.total)} MiB at {sizer.n_ctx_cap} tokens + {per_token:.1f} B of "
                f"KV per token beyond), {where}")
    budget.refuse(f"--ctx {n_ctx}", _allocation(sizer, n_ctx, budget) or sizer.at(n_ctx))


def _check_embedding(sizer: _Sizer) -> None:
    """An embedding context past the training context is refused (its positions would be
    ones the model never saw)."""
    spec, train = sizer.specs.embedding, sizer.model.n_ctx_train
    if spec is not None and spec.n_batch > train:
        raise FitError(f"--embeddings {sizer.config.embedding_tokens} ({spec.n_batch} tokens, "
                       f"a multiple of {EMBEDDING_SEQS}) exceeds the model's training context "
                       f"({train} tokens)")


def _kv_bytes_per_token(sizer: _Sizer, n_ctx: int) -> float:
    """The KV cache's marginal bytes per context token at ``n_ctx`` (no_alloc: free).

    Measured over up to ``_KV_PROBE_SPAN`` tokens above ``n_ctx`` that stay within the
    training context, or, at the training context, over the span just below it: a probe
    beyond it would make llama.cpp warn of a training-context overflow nobody asked for.
    """
    if n_ctx + CTX_STEP <= sizer.n_ctx_cap:
        lo, hi = n_ctx, min(n_ctx + _KV_PROBE_SPAN, sizer.n_ctx_cap)
    else:
        lo, hi = max(n_ctx - _KV_PROBE_SPAN, n_ctx // 2), n_ctx
    return (sum(sizer.target(hi).kv.values()) - sum(sizer.target(lo).kv.values())) / (hi - lo)


def _report(sizer: _Sizer, n_ctx: int, budget: _Budgets, source: str,
            group: DeviceGroup) -> FitReport:
    fitted = sizer.allocated(n_ctx)
    details: dict[str, object] = {
        "memory_source": budget.source,
        "n_ctx_source": source,  # "fitted", or "fixed" by the operator (--ctx)
        "n_rs_seq": sizer.specs.plan.n_rs_seq,
        "checkpoint_mode": (sizer.specs.plan.checkpoint.value
                            if sizer.specs.plan.checkpoint else None),
        "kv_bytes_per_token": round(_kv_bytes_per_token(sizer, n_ctx), 1),
        "host_bytes": fitted.host_bytes,
        "runtime_growth_bytes": fitted.runtime_growth,
        "recurrent_reported_bytes": fitted.recurrent_reported,
        "next_step_total_bytes": ((_allocation(sizer, n_ctx + CTX_STEP, budget)
                                   or sizer.at(n_ctx + CTX_STEP)).total
                                  if n_ctx < sizer.n_ctx_cap else None),
        **_state_details(sizer, n_ctx, fitted),
        "prefix_checkpoints_per_slot": (sizer.config.prefix_checkpoints
                                        if sizer.prefix_checkpoint else 0),
        "prefix_checkpoint_bytes": sizer.prefix_checkpoint,
        # Host only: llama.cpp keeps one ON_DEVICE checkpoint per sequence, compact rollback's.
        "prefix_checkpoint_mode": "host" if sizer.prefix_checkpoint else None,
        # Where llama.cpp put the model's layers (the output layer counts as one), and how.
        "device_layers": sizer.layers,
        "split_mode": group.split_mode.value,
        "tensor_split": list(group.tensor_split) if group.tensor_split else None,
    }
    return FitReport(
        model_path=sizer.config.model_path, n_ctx=n_ctx, n_ctx_train=sizer.model.n_ctx_train,
        slots=sizer.slots, total_bytes=fitted.total, budget_bytes=budget.available,
        devices=[DeviceFit(device=b.memory.device, total_bytes=b.memory.total_bytes,
                           free_bytes=b.memory.free_bytes, margin_bytes=b.margin,
                           components=fitted.per_device[b.memory.device])
                 for b in budget.each],
        spec_method=str(sizer.specs.plan.method), draft_max=sizer.specs.plan.draft_max,
        # The snapshots really kept (D, or N when unset); none on a pure-attention model.
        rollback_depth=sizer.specs.plan.n_rs_seq or None, components=fitted.components,
        details=details,
    )


def _state_details(sizer: _Sizer, n_ctx: int, fitted: Breakdown) -> dict[str, object]:
    """Recurrent figures: exact group and checkpoint sizes, and the plane delta (target at
    n_rs_seq = D + 1 minus at D: docs/fitter.md, "What is measured how"), kept only as a
    diagnostic."""
    if sizer.state is None:
        return {}
    one_more = sizer.target(n_ctx, sizer.specs.plan.n_rs_seq + 1)
    return {
        "snapshot_group_bytes": sizer.state.group,
        "checkpoint_device_bytes_per_slot": sizer.state.group,
        "checkpoint_host_bytes_per_slot": sizer.state.host_checkpoint,
        "rs_plane_delta_bytes": one_more.recurrent_total - fitted.recurrent_reported,
    }
