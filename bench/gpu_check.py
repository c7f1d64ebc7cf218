"""What only a machine with an NVIDIA GPU can verify, checked in one run and written as a report.

``bench/gpu_check.sh`` builds llama-cpp-python with CUDA into its own virtual env and runs this
with it. Each check records pass / fail / skipped with its figures; the run goes on after a
failure and exits non-zero if any check failed.

- ``environment``: llama.cpp's GPU offload, NVML's devices (index, name, UUID, memory), the
  CUDA ordering variables.
- ``fit-vs-nvml``: ``specfleet fit --device cuda:N --json`` on the model (Gemma 3 270M unless
  ``--model``) for every GPU; the free memory it measured must be NVML's for that index (the
  fitter reads NVML by index).
- ``pinning``: a worker started with ``--device cuda:N`` must allocate on NVML device N (its
  pid in ``nvidia-smi --query-compute-apps``, matched by UUID). CUDA numbers devices fastest
  first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML by PCI bus: on a mixed-GPU host the two
  orders differ, and this is where that shows.
- ``device-checkpoint``: the tiny hybrid (MTP head) served with ``--checkpoint device`` and
  ``--rollback-depth 1`` (every deeper rejection restores the checkpoint) must save device
  checkpoints with no host fallback, and produce exactly the tokens of ``--checkpoint host``.
- ``sampling``: speculative sampling on the device: MTP sampled with a seed repeats its
  tokens, n-gram speculation gives plain sampling's tokens with the same seed.
- ``greedy``: greedy speculation on the device keeps plain decoding's tokens: MTP, n-gram
  and suffix drafting on the tiny hybrid (F32, wide margins) give plain's tokens exactly,
  on one slot and with four requests at once (batched verifies of several sequences).
- ``deterministic``: ``--deterministic`` on a GPU worker is refused before it loads, with the
  message naming the CPU backend (docs/engine.md, "Deterministic mode").
- ``service``: a worker fitted to the GPU by the fitter (no ``--ctx``) serves a batch through
  Redis; every job finishes; the registration says the device; SIGTERM drains and exits 0.
- ``decode-timing``: ``bench/decode_timing.py --gpu`` on the tiny models (and on Gemma,
  where it is the run's model): a decode timed queued against finished, steady decoding at a
  constant width against varying widths (CUDA graphs), and a speculative run's widths as
  drafted against padded to replayable row counts (``--verify-buckets``;
  ``spec_bucketed_vs_raw`` below 1: the replays pay for their pad rows); figures only.
- ``slots``: ``bench/slots.py --gpu`` (the multi-slot bench, on Gemma), its markdown tables
  appended.
- ``device-verify``: the same bench at K = 1 and 8 with greedy verify rows reduced on the
  device and with every row read by Python: tokens per second, the host's share of a step,
  logits rows read a token (none with it on; docs/engine.md, "Verify on the device").
- ``device-draws``: sampled rows drawn on the GPU (``bench/spec_sampling.py
  --device-compare --gpu``, small): every draw kind, a top-p nucleus over Gemma's vocabulary
  included, draws on the device and is compared with the host's draw; no logits row is read
  with device verify on at T 0.7 and top-p 0.9.
- ``spec-targets``: issue 47's targets for the default drafter on the GPU, from
  ``bench/slots.py`` (plain against default, 2 rounds, 64 tokens a request, the worker's
  defaults: verify on the device, replayable shapes): at least plain's aggregate at K = 1,
  2, 4 and 8 on the task mix, at least twice plain's on copy-heavy requests at K = 1, and
  the host at most a fifth of the default drafter's step everywhere. Skipped on a CPU run.
- ``device-group``: one model over the first two GPUs (docs/fitter.md, "Device groups"), the
  checks of tests/multidevice: each device's fitted figure within 2% of what llama.cpp
  allocated there (the tiny dense model, and the hybrid with MTP and compact rollback), the
  greedy output of one GPU over the group in either order, with ``--split-mode none`` and
  ``row``, the reversed order moving the first layers, and a budget one device cannot meet
  refused naming it. Skipped, saying so, with one GPU; a CPU run does the same over the host
  and two RPC device processes (no row split there), so the check itself is tested here.

``--model tiny`` runs the model checks (fit, pinning, service) on the project's tiny dense
model instead of Gemma, for a host that cannot fetch Gemma (skip ``slots`` there).

``--device cpu`` runs the same plumbing on a host without a GPU (NVML checks skipped): that is
how the script itself is tested where no GPU is lent.

    python bench/gpu_check.py --report gpu-report.md [--device cuda] [--skip slots]
        [--model gemma|tiny|PATH] [--jobs 16] [--tokens 128] [--threads 4] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import Coordinator  # noqa: E402
from coordinator.processes import stop_processes  # noqa: E402
from coordinator.redis_local import local_redis  # noqa: E402
from coordinator.rpc_local import local_rpc_devices  # noqa: E402
from shared.logs import configure_logging  # noqa: E402
from shared.protocol import JobStatus, SpecMethod  # noqa: E402
from shared.settings import Settings  # noqa: E402
from worker.engine.engine import SpeculativeEngine  # noqa: E402
from worker.fitter import fit_worker, reserve_checkpoints  # noqa: E402
from worker.fitter.buffers import parse_buffers  # noqa: E402
from worker.fitter.devices import device_map  # noqa: E402
from worker.launch import EngineCapacity, parse_device_group  # noqa: E402
from worker.llm import capture_llama_log  # noqa: E402
from worker.llm.placement import placed  # noqa: E402
from worker.testmodels import build_tiny_models  # noqa: E402
from worker.testmodels.gemma import gemma_q4_path  # noqa: E402

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
#: NVML's free memory moves while we look (other processes, the driver): allowed drift.
FREE_DRIFT_BYTES = 512 * MIB
REGISTER_TIMEOUT_S = 600


@dataclass
class Check:
    name: str
    status: str = "pass"  # pass | fail | skipped
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def require(self, ok: bool, note: str) -> None:
        self.notes.append(("ok: " if ok else "FAILED: ") + note)
        if not ok:
            self.status = "fail"


@dataclass
class Context:
    args: argparse.Namespace
    work: Path
    redis_url: str
    #: The dense model of the fit, pinning and service checks.
    model: Path
    hybrid: Path
    gpus: list[dict[str, Any]]
    #: The tiny dense model (the device-group check's; ``model`` may be Gemma).
    dense: Path

    def devices(self) -> list[str]:
        if self.args.device == "cpu":
            return ["cpu"]
        return [f"cuda:{g['index']}" for g in self.gpus]


def nvml_devices() -> list[dict[str, Any]]:
    """Every GPU NVML sees, by NVML index (PCI bus order), with its memory now."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid_ = pynvml.nvmlDeviceGetUUID(handle)
            out.append({"index": index, "name": name.decode() if isinstance(name, bytes)
                        else name, "uuid": uuid_.decode() if isinstance(uuid_, bytes) else uuid_,
                        "total_bytes": int(memory.total), "free_bytes": int(memory.free)})
        return out
    finally:
        pynvml.nvmlShutdown()


def _specfleet(*args: str, env: dict[str, str] | None = None,
               timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "specfleet"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@contextmanager
def worker(ctx: Context, name: str, model: Path, device: str, *extra: str,
           prefix: str) -> Iterator[tuple[subprocess.Popen[bytes], Coordinator]]:
    """A real ``specfleet worker`` serving ``model`` as ``name``, registered before yield."""
    settings = Settings(redis_url=ctx.redis_url, prefix=prefix)
    env = {**os.environ, "REDIS_URL": ctx.redis_url, "SPECFLEET_PREFIX": prefix,
           "SPECFLEET_LOG_LEVEL": "info"}
    log = (ctx.work / f"{name}.log").open("wb")
    proc = subprocess.Popen([str(BIN / "specfleet"), "worker", "--model", str(model),
                             "--model-name", name, "--name", name, "--device", device,
                             "--threads", str(ctx.args.threads), *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    coordinator = Coordinator(settings)
    try:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while not coordinator.registry.is_alive(name):
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited ({proc.returncode}): "
                                   f"{(ctx.work / f'{name}.log').read_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not register in {REGISTER_TIMEOUT_S}s")
            time.sleep(0.2)
        yield proc, coordinator
    finally:
        stop_processes([proc], timeout=120)


def check_environment(ctx: Context, check: Check) -> None:
    import llama_cpp

    offload = bool(llama_cpp.llama_supports_gpu_offload())
    check.figures = {"llama_supports_gpu_offload": offload, "gpus": ctx.gpus,
                     "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                     "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER")}
    if ctx.args.device == "cpu":
        check.notes.append("cpu run: no GPU expected")
        return
    check.require(offload, "llama.cpp was built with GPU offload")
    check.require(bool(ctx.gpus), f"NVML sees {len(ctx.gpus)} GPU(s)")


def check_fit_vs_nvml(ctx: Context, check: Check) -> None:
    for device in ctx.devices():
        done = _specfleet("fit", "--model", str(ctx.model), "--device", device, "--json")
        check.require(done.returncode == 0, f"specfleet fit --device {device}"
                      + ("" if done.returncode == 0 else f": {done.stderr.strip()[-300:]}"))
        if done.returncode != 0:
            continue
        report = json.loads(done.stdout)
        measured = report["devices"][0]
        check.figures[device] = {"n_ctx": report["n_ctx"], "free_bytes": measured["free_bytes"],
                                 "total_bytes": measured["total_bytes"]}
        if device == "cpu":
            continue
        nvml = nvml_devices()[int(device.split(":")[1])]
        drift = abs(nvml["free_bytes"] - measured["free_bytes"])
        check.figures[device]["nvml_free_bytes"] = nvml["free_bytes"]
        check.require(measured["total_bytes"] == nvml["total_bytes"],
                      f"{device}: fit's total = NVML index {nvml['index']}'s total")
        check.require(drift <= FREE_DRIFT_BYTES,
                      f"{device}: fit's free is NVML's within {drift / MIB:.0f} MiB")


def check_pinning(ctx: Context, check: Check) -> None:
    if ctx.args.device == "cpu" or shutil.which("nvidia-smi") is None:
        check.status = "skipped"
        check.notes.append("needs GPUs and nvidia-smi")
        return
    for device in ctx.devices():
        index = int(device.split(":")[1])
        with worker(ctx, f"pin{index}", ctx.model, device, "--ctx", "2048",
                    prefix=f"gpucheck-{uuid.uuid4().hex[:8]}") as (proc, _):
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                                   "--format=csv,noheader"], capture_output=True, text=True,
                                  check=True).stdout
            used = {line.split(",")[1].strip() for line in apps.splitlines()
                    if line.split(",")[0].strip() == str(proc.pid)}
        expected = ctx.gpus[index]["uuid"]
        check.figures[device] = {"expected_uuid": expected, "used_uuids": sorted(used)}
        check.require(used == {expected},
                      f"--device {device} allocates on NVML index {index} only")


def _run_jobs(coordinator: Coordinator, model: str, prompts: list[list[int]],
              max_tokens: int, spec: dict[str, Any],
              sampling: dict[str, Any] | None = None) -> list[Any]:
    handles = [coordinator.submit({"model": model, "prompt_tokens": p, "max_tokens": max_tokens,
                                   "speculative": spec, "sampling": sampling or {}})
               for p in prompts]
    return [h.result(timeout=600) for h in handles]


def check_device_checkpoint(ctx: Context, check: Check) -> None:
    device = ctx.devices()[0]
    prompts = [[1 + (i * 7 + j) % 50 for j in range(12)] for i in range(4)]
    spec = {"method": "mtp", "draft_max": 8}
    runs: dict[str, list[Any]] = {}
    for mode in ("device", "host"):
        with worker(ctx, f"ckpt-{mode}", ctx.hybrid, device, "--ctx", "1024", "--checkpoint",
                    mode, "--rollback-depth", "1", "--draft-max", "8",
                    prefix=f"gpucheck-{uuid.uuid4().hex[:8]}") as (_, coordinator):
            runs[mode] = _run_jobs(coordinator, f"ckpt-{mode}", prompts, ctx.args.tokens, spec)
    device_run = runs["device"]
    telemetry = [r.telemetry for r in device_run]
    check.figures = {
        "checkpoint_modes": sorted({t.checkpoint_mode or "-" for t in telemetry}),
        "checkpoint_saves": sum(t.checkpoint_saves for t in telemetry),
        "replay_events": sum(t.replay_events for t in telemetry),
        "host_fallbacks": sum(t.host_fallbacks for t in telemetry),
        "host_fallback_reasons": sorted({t.host_fallback_reason or "-" for t in telemetry}),
    }
    check.require(all(r.status is JobStatus.FINISHED for rs in runs.values() for r in rs),
                  "every job finished")
    check.require(check.figures["checkpoint_modes"] == ["device"], "checkpoints on the device")
    check.require(check.figures["checkpoint_saves"] > 0, "device checkpoints were saved")
    check.require(check.figures["host_fallbacks"] == 0, "no fallback to host storage")
    check.require([r.tokens for r in device_run] == [r.tokens for r in runs["host"]],
                  "device and host checkpoints give the same tokens")


def check_sampling(ctx: Context, check: Check) -> None:
    """Speculative sampling on the GPU: MTP drafts sampled from the head, verified by rejection
    sampling, repeat with the same seeds; n-gram speculation gives plain sampling's tokens."""
    device = ctx.devices()[0]
    prompts = [[1 + (i * 11 + j) % 60 for j in range(10)] for i in range(4)]
    sampling = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}
    with worker(ctx, "sampling", ctx.hybrid, device, "--ctx", "1024", "--draft-max", "4",
                prefix=f"gpucheck-{uuid.uuid4().hex[:8]}") as (_, coordinator):
        runs = {name: _run_jobs(coordinator, "sampling", prompts, ctx.args.tokens,
                                {"method": method}, sampling)
                for name, method in (("mtp", "mtp"), ("mtp-again", "mtp"), ("ngram", "ngram"),
                                     ("plain", "none"))}
    tokens = {name: [r.tokens for r in rs] for name, rs in runs.items()}
    mtp = [r.telemetry for r in runs["mtp"]]
    check.figures = {"mtp_acceptance": round(sum(t.accepted for t in mtp)
                                             / max(1, sum(t.drafted for t in mtp)), 3),
                     "seeds": sorted({r.seed for rs in runs.values() for r in rs})}
    check.require(all(r.status is JobStatus.FINISHED for rs in runs.values() for r in rs),
                  "every job finished")
    check.require(tokens["mtp"] == tokens["mtp-again"], "MTP sampling repeats with its seed")
    check.require(tokens["ngram"] == tokens["plain"],
                  "n-gram speculative sampling gives plain sampling's tokens")


def check_greedy(ctx: Context, check: Check) -> None:
    """Greedy speculation on the device against plain decoding on the device, token for token.

    A GPU's kernels are chosen by batch shape, so a batched verify is not bit-identical to a
    one-row decode; the tiny hybrid is F32 with margins far wider than that noise, so any
    difference here is a rollback or bookkeeping fault, not rounding."""
    device = ctx.devices()[0]
    # Repeating prompts, so that n-gram lookup finds something to draft too.
    prompts = [[1 + i * 17 + j for j in range(5)] * 3 for i in range(4)]
    methods = {"plain": "none", "mtp": "mtp", "ngram": "ngram", "suffix": "suffix"}
    with worker(ctx, "greedy", ctx.hybrid, device, "--ctx", "1024", "--slots", "4",
                "--draft-max", "8", prefix=f"gpucheck-{uuid.uuid4().hex[:8]}") as (_, coordinator):
        runs = {name: _run_jobs(coordinator, "greedy", prompts, ctx.args.tokens,
                                {"method": method}) for name, method in methods.items()}
        # One request at a time: each verify holds one sequence's draft only.
        single = [_run_jobs(coordinator, "greedy", [p], ctx.args.tokens, {"method": "mtp"})[0]
                  for p in prompts]
    tokens = {name: [r.tokens for r in rs] for name, rs in runs.items()}
    drafted = {name: sum(r.telemetry.drafted for r in rs) for name, rs in runs.items()}
    check.figures = {name: {"drafted": drafted[name],
                            "acceptance": round(sum(r.telemetry.accepted for r in rs)
                                                / max(1, drafted[name]), 3),
                            "tokens": sum(len(r.tokens) for r in rs)}
                     for name, rs in runs.items() if name != "plain"}
    check.require(all(r.status is JobStatus.FINISHED for rs in runs.values() for r in rs),
                  "every job finished")
    for name in methods:
        if name != "plain":
            # How many draft rows a step verifies is the row budget's call from measured
            # costs, so the count is reported, not required: a 0 makes the match trivial.
            check.require(tokens[name] == tokens["plain"], f"{name}, 4 requests at once, "
                          f"gives plain's tokens ({drafted[name]} tokens drafted)")
    check.require([r.tokens for r in single] == tokens["plain"],
                  "mtp, one request at a time, gives plain's tokens")


def check_device_rows(ctx: Context, check: Check) -> None:
    """Rows reduced on the device (greedy top two, keyed draws with and without the top-k,
    top-p and min-p cuts, of raw or penalised logits, mixed) keep their own results
    while sequences go idle in turn, the model's layers on the GPU: the suite's test of it
    (``test_every_row_is_its_own_while_sequences_go_idle``), offloaded."""
    env = {**os.environ, "SPECFLEET_TEST_GPU_LAYERS": "0" if ctx.args.device == "cpu" else "-1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "engine" / "test_device_sampling.py"),
                           "-k", "go_idle"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)
    check.figures = {"pytest": done.stdout.strip().splitlines()[-1:]}
    check.require(done.returncode == 0, "every row's top two and draw are the host's, "
                  "greedy, sampled (cut, nucleus, penalised) and mixed sequences going idle "
                  "in turn")


def check_deterministic(ctx: Context, check: Check) -> None:
    """The flag is refused where it cannot be kept, before the worker loads anything."""
    device = ctx.devices()[0]
    if device == "cpu":
        check.status = "skipped"
        check.notes.append("the CPU backend keeps deterministic mode (tests/engine)")
        return
    started = time.monotonic()
    done = _specfleet("worker", "--model", str(ctx.hybrid), "--device", device,
                      "--deterministic", timeout=120,
                      env={"REDIS_URL": ctx.redis_url, "SPECFLEET_PREFIX": "gpucheck-det"})
    check.figures = {"exit_code": done.returncode,
                     "seconds": round(time.monotonic() - started, 2),
                     "stderr_tail": done.stderr.strip()[-300:]}
    check.require(done.returncode != 0, f"--device {device} --deterministic is refused")
    check.require("--device cpu" in done.stderr, "the message names the CPU backend")


def check_service(ctx: Context, check: Check) -> None:
    device = ctx.devices()[0]
    prefix = f"gpucheck-{uuid.uuid4().hex[:8]}"
    with worker(ctx, "service", ctx.model, device, prefix=prefix) as (proc, coordinator):
        info = coordinator.registry.live_workers("service")[0]
        started = time.monotonic()
        # Ids every model here has (the tiny ones have 256 tokens).
        results = _run_jobs(coordinator, "service", [[2, 16, 40, 57, 96]] * ctx.args.jobs,
                            ctx.args.tokens, {"method": "ngram"})
        elapsed = time.monotonic() - started
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        left = coordinator.registry.is_alive("service")
    tokens = sum(len(r.tokens) for r in results)
    check.figures = {"device": info.device, "n_ctx": info.n_ctx,
                     "fit_devices": [d.device for d in info.fit.devices] if info.fit else None,
                     "jobs": len(results), "tokens": tokens,
                     "aggregate_tokens_per_second": round(tokens / elapsed, 1),
                     "exit_code": code}
    check.require(info.device == device, f"registered as {device}")
    check.require(info.fit is not None, "fitted by the fitter (no --ctx)")
    check.require(all(r.status is JobStatus.FINISHED for r in results),
                  f"all {ctx.args.jobs} jobs finished")
    check.require(code == 0 and not left, "SIGTERM drained, deregistered and exited 0")


def _bench(ctx: Context, check: Check, script: str, *args: str,
           timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``bench/<script>`` on the checked device (``--gpu`` unless a cpu run)."""
    argv = [sys.executable, str(ROOT / "bench" / script), *args,
            "--threads", str(ctx.args.threads)]
    if ctx.args.device != "cpu":
        argv.append("--gpu")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    check.require(done.returncode == 0, f"bench/{script}"
                  + ("" if done.returncode == 0 else f": {done.stderr.strip()[-300:]}"))
    return done


def check_decode_timing(ctx: Context, check: Check) -> None:
    models = ["tiny"] if ctx.args.model == "tiny" or ctx.args.device == "cpu" else \
        ["tiny", ctx.args.model]
    for model in models:
        done = _bench(ctx, check, "decode_timing.py", "--model", model, "--reps", "3",
                      timeout=600)
        if done.returncode != 0:
            continue
        for name, figures in json.loads(done.stdout)["models"].items():
            ms = figures["steady_ms_per_step"]
            figures["spec_bucketed_vs_raw"] = round(ms["spec_bucketed"] / ms["spec_raw"], 3)
            check.figures[name] = figures


def _gemma(ctx: Context) -> tuple[str, ...]:
    """The slots bench writes text prompts: Gemma's tokenizer, never the tiny models'."""
    return () if ctx.args.model in ("gemma", "tiny") else ("--model", ctx.args.model)


def check_slots(ctx: Context, check: Check) -> None:
    done = _bench(ctx, check, "slots.py", "--tokens", "64", "--markdown", *_gemma(ctx),
                  timeout=3600)
    check.figures["output"] = done.stdout


def check_device_verify(ctx: Context, check: Check) -> None:
    """The default drafter with greedy verify rows reduced on the device against the same
    with every row read by Python, K = 1 and 8, interleaved round by round (the slots
    bench's own rounds): tokens per second, host share of the step, logits rows read."""
    figures: dict[str, Any] = {}
    for mode in ("off", "on"):
        done = _bench(ctx, check, "slots.py", "--tokens", "64", "--concurrency", "1,8",
                      "--methods", "plain,default", "--skip", "ttft,memory", "--reps", "2",
                      "--device-verify", mode, *_gemma(ctx), timeout=1800)
        if done.returncode == 0:
            figures[mode] = {name: {k: {key: row.get(key) for key in (
                "slots_tok_s", "vs_plain", "host_ms_per_token", "host_share",
                "rows_read_per_token")} for k, row in rows.items()}
                for name, rows in json.loads(done.stdout)["throughput"].items()}
    check.figures = figures
    if set(figures) == {"off", "on"}:
        check.require(all(row["rows_read_per_token"] == 0
                          for row in figures["on"]["default"].values()),
                      "the default drafter read no logits row with device verify on")


def check_device_draws(ctx: Context, check: Check) -> None:
    """Sampled rows drawn on the GPU (``bench/spec_sampling.py --device-compare --gpu``): the
    side by side at T 0.7 and top-p 0.9 reads no logits row with device verify on, and every
    draw kind, the top-p nucleus over Gemma's 262,144 ids included (ggml's CUDA argsort, CUB
    for so wide a row), draws on the device, each compared with the host's draw from the same
    row and uniform."""
    if ctx.args.device == "cpu":
        check.status = "skipped"
        check.notes.append("on a CPU a nucleus over Gemma's vocabulary is read, not drawn "
                           "(device_sampling.CPU_SORT_MAX); tests/engine/test_draw_graph.py "
                           "computes the graph on the CPU backend")
        return
    done = _bench(ctx, check, "spec_sampling.py", "--device-compare", "--reps", "1", "--seeds",
                  "1", "--tokens", "32", "--draw-seeds", "10", "--markdown", *_gemma(ctx),
                  timeout=900)
    if done.returncode != 0:
        return
    summary, end = json.JSONDecoder().raw_decode(done.stdout)  # then its markdown tables
    check.figures = {"draws": summary["draws"], "output": done.stdout[end:].strip()}
    check.require(all(v == 1.0 for d in summary["draws"].values()
                      for k, v in d.items() if k.endswith("on the device")),
                  "every draw kind, a top-p nucleus included, draws on the device")
    check.require(all(c["rows_read_per_token"] == 0 for by_config in summary["medians"].values()
                      for name, c in by_config.items() if name.endswith("device-on")),
                  "no logits row read with device verify on (T 0.7, top-p 0.9)")


#: Issue 47's targets for the default drafter on a GPU: its aggregate over plain's at every
#: K of the task mix, over plain's on copy-heavy requests at K = 1, and the most of its step
#: the host may take (wall time less the target's decodes).
SPEC_TARGETS = {"vs_plain": 1.0, "copy_vs_plain": 2.0, "host_share": 0.20}
#: The slots bench runs the targets are read from: the task mix at every K, copying at K = 1.
SPEC_RUNS = {"mixed": ("--concurrency", "1,2,4,8"),
             "copy": ("--concurrency", "1", "--tasks", "copy")}


def check_spec_targets(ctx: Context, check: Check) -> None:
    """Plain against the default drafter, as a worker on this GPU serves them (its defaults:
    greedy verify rows reduced on the device, steps padded to replayable shapes), held to
    :data:`SPEC_TARGETS`."""
    if ctx.args.device == "cpu":
        check.status = "skipped"
        check.notes.append("the targets are a GPU's (a CPU's figures: docs/benchmarks.md)")
        return
    keys = ("slots_tok_s", "vs_plain", "host_share", "ms_per_step", "rows_per_step",
            "padded_rows_per_step", "tokens_per_step", "acceptance")
    for run, extra in SPEC_RUNS.items():
        done = _bench(ctx, check, "slots.py", "--tokens", "64", *extra, "--methods",
                      "plain,default", "--skip", "ttft,memory", "--reps", "2", *_gemma(ctx),
                      timeout=600)
        if done.returncode == 0:
            check.figures[run] = {name: {k: {key: row.get(key) for key in keys}
                                         for k, row in rows.items()}
                                  for name, rows in json.loads(done.stdout)["throughput"].items()}
    for run, floor in (("mixed", SPEC_TARGETS["vs_plain"]),
                       ("copy", SPEC_TARGETS["copy_vs_plain"])):
        for k, row in check.figures.get(run, {}).get("default", {}).items():
            check.require(row["vs_plain"] >= floor, f"{run}, K = {k}: the default drafter "
                          f"{row['vs_plain']:.2f}x plain (target >= {floor:g}x)")
            check.require(row["host_share"] <= SPEC_TARGETS["host_share"],
                          f"{run}, K = {k}: the host {row['host_share']:.0%} of the default "
                          f"drafter's step (target <= {SPEC_TARGETS['host_share']:.0%})")


#: The device-group runs: each tiny model with its drafter, the hybrid with compact rollback
#: (D = 1 < N = 3), so its device checkpoints live on the device of its recurrent layers.
GROUP_RUNS = {"dense": EngineCapacity(method=SpecMethod.NGRAM, draft_max=4),
              "hybrid": EngineCapacity(method=SpecMethod.MTP, draft_max=3, rollback_depth=1)}
#: How far a device's fitted figure may sit from what llama.cpp allocated on it.
GROUP_TOLERANCE = 0.02
#: Each device's budget for the group fits (MiB): small, so the fits are the same anywhere.
GROUP_BUDGET_MIB = 64
#: llama.cpp's buffer kinds, as logged when it really allocates one.
ALLOCATED = ("model", "kv_buffer", "recurrent", "output", "compute", "checkpoint")


@dataclass(frozen=True)
class Group:
    """The devices a group check spans: ``--device``/``--rpc`` for it and for the same
    reversed, the one device its output is compared with, and the fitted devices in the
    model's order (the host first where it is one)."""

    args: tuple[str, ...]
    reversed_args: tuple[str, ...]
    alone: tuple[str, ...]
    members: tuple[str, ...]

    @property
    def offload(self) -> tuple[str, ...]:
        """The members that take layers."""
        return tuple(m for m in self.members if m != "cpu")

    def flag(self, name: str) -> str | None:
        return self.args[self.args.index(name) + 1] if name in self.args else None


def _run_args(capacity: EngineCapacity) -> tuple[str, ...]:
    """``capacity`` as the CLI takes it."""
    depth = capacity.rollback_depth
    return ("--spec", str(capacity.method), "--draft-max", str(capacity.draft_max),
            *(("--rollback-depth", str(depth)) if depth is not None else ()))


def _engine_against_fit(model: str, device: str, rpc: str | None, capacity: EngineCapacity,
                        threads: int) -> dict[str, dict[str, float]]:
    """Fit ``model`` on the group, build the engine from the fit under the same placement
    and reserve its checkpoints; per device what the fit said (as at load: the output growth
    and the engine's host caches left out) and what llama.cpp logged allocating there.

    Runs in a child process: its connections to RPC devices end with it (a device serves
    one client at a time), and its GPU contexts with them."""
    configure_logging(level="warning")
    group = parse_device_group(device, rpc)
    with placed(group) as placement:
        fit = fit_worker(model, device=group, budget_mib=GROUP_BUDGET_MIB, fit_target_mib=0,
                         capacity=capacity, ctx_min=256, n_threads=threads)
        with capture_llama_log() as lines:
            engine = SpeculativeEngine(fit.config)
            report = reserve_checkpoints(engine, fit)
        engine.close()
        where = device_map(group, placement)
    found = parse_buffers(lines)
    figures = {}
    for d in report.devices:
        c = d.components
        growth = report.details["runtime_growth_bytes"] if d.device == where.host else 0
        fitted = sum(c.values()) - c["prefix_checkpoints"] - c["lookup_cache"] - growth
        allocated = sum(found.by_device(kind, where)[d.device] for kind in ALLOCATED)
        figures[d.device] = {"n_ctx": report.n_ctx, "fitted_mib": round(fitted / MIB, 3),
                             "allocated_mib": round(allocated / MIB, 3),
                             "deviation": round(fitted / allocated - 1, 4) if allocated else 0}
    return figures


def _group_generate(ctx: Context, model: Path, capacity: EngineCapacity,
                    *group: str) -> list[int] | str:
    """Greedy tokens of ``specfleet generate`` on ``group`` (its error when it failed)."""
    done = _specfleet("generate", "--model", str(model), "--prompt-tokens",
                      "5,17,42,99,3,250,8,61", "--max-tokens", "32", "--ctx", "256",
                      "--threads", str(ctx.args.threads), "--json", *_run_args(capacity),
                      *group)
    return json.loads(done.stdout)["tokens"] if done.returncode == 0 else done.stderr[-300:]


def _group_fit(ctx: Context, check: Check, *args: str) -> dict[str, Any] | None:
    """``specfleet fit --json`` of the hybrid on a group (None when it failed: noted)."""
    done = _specfleet("fit", "--model", str(ctx.hybrid), *_run_args(GROUP_RUNS["hybrid"]),
                      "--fit-target-mib", "0", "--ctx-min", "256", "--threads",
                      str(ctx.args.threads), "--json", *args)
    check.require(done.returncode == 0, f"specfleet fit {' '.join(args)}"
                  + ("" if done.returncode == 0 else f": {done.stderr.strip()[-300:]}"))
    return json.loads(done.stdout) if done.returncode == 0 else None


def _run_group(ctx: Context, check: Check, group: Group) -> None:
    """tests/multidevice's checks on ``group``: each device's fit within 2% of llama.cpp's
    allocation; the greedy output of one device over the group, in either order, with
    ``--split-mode none`` and, over GPUs, by rows; reversing the order reverses the split;
    a budget one device cannot meet is refused naming it."""
    models = {"dense": ctx.dense, "hybrid": ctx.hybrid}
    spawn = multiprocessing.get_context("spawn")
    for name, capacity in GROUP_RUNS.items():
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            figures = pool.submit(_engine_against_fit, str(models[name]),
                                  group.flag("--device") or "cpu", group.flag("--rpc"),
                                  capacity, ctx.args.threads).result(timeout=900)
        check.figures[f"{name}_fit_vs_allocated"] = figures
        for member, f in figures.items():
            check.require(abs(f["deviation"]) <= GROUP_TOLERANCE,
                          f"{name}: {member} fitted {f['fitted_mib']} MiB, llama.cpp allocated "
                          f"{f['allocated_mib']} MiB (within {GROUP_TOLERANCE:.0%})")
        alone = _group_generate(ctx, models[name], capacity, *group.alone)
        variants = {"group": group.args, "reversed": group.reversed_args,
                    "split-mode none": (*group.args, "--split-mode", "none")}
        if ctx.args.device == "cuda":
            variants["split-mode row"] = (*group.args, "--split-mode", "row")
        for label, args in variants.items():
            tokens = _group_generate(ctx, models[name], capacity, *args)
            check.require(isinstance(alone, list) and tokens == alone,
                          f"{name}, {label}: the greedy output of {' '.join(group.alone) or 'cpu'}"
                          + ("" if isinstance(tokens, list) else f" ({tokens})"))
    budget = ("--budget-mib", str(GROUP_BUDGET_MIB))
    first, last = group.offload[0], group.offload[-1]
    forward = _group_fit(ctx, check, *group.args, *budget)
    backward = _group_fit(ctx, check, *group.reversed_args, *budget)
    if forward and backward:
        check.figures["device_layers"] = {"forward": forward["details"]["device_layers"],
                                          "reversed": backward["details"]["device_layers"]}
        held = [{d["device"]: d["components"]["recurrent"] for d in r["devices"]}
                for r in (forward, backward)]
        check.require(held[0][first] > 0 == held[0][last] and held[1][last] > 0 == held[1][first],
                      f"reversing the order moves the first layers (the recurrent ones) from "
                      f"{first} to {last}")
    none = _group_fit(ctx, check, *group.args, *budget, "--split-mode", "none")
    if none:
        layers = none["details"]["device_layers"]
        check.require(layers[first] > 0 and not any(layers[d] for d in group.offload[1:]),
                      f"--split-mode none: every layer on {first}")
    starved = ",".join([str(GROUP_BUDGET_MIB)] * (len(group.members) - 1) + ["0.3"])
    done = _specfleet("fit", "--model", str(ctx.hybrid), *_run_args(GROUP_RUNS["hybrid"]),
                      "--fit-target-mib", "0", *group.args, "--budget-mib", starved)
    check.figures["refused"] = done.stderr.strip()[-400:]
    check.require(done.returncode == 2 and f"do not fit on {last}" in done.stderr,
                  f"a budget {last} cannot meet is refused naming it")


def check_device_group(ctx: Context, check: Check) -> None:
    """One model over several devices (docs/fitter.md, "Device groups"): two GPUs where the
    machine has them; on a CPU run the host and two RPC device processes, so the check's own
    plumbing runs wherever the script is tested."""
    if ctx.args.device == "cuda":
        if len(ctx.gpus) < 2:
            check.status = "skipped"
            check.notes.append(f"needs two or more GPUs, NVML sees {len(ctx.gpus)}: the same "
                               "checks run over RPC devices in a CPU run and in "
                               "tests/multidevice")
            return
        a, b = (f"cuda:{g['index']}" for g in ctx.gpus[:2])
        _run_group(ctx, check, Group(("--device", f"{a},{b}"), ("--device", f"{b},{a}"),
                                     ("--device", a), (a, b)))
        return
    with local_rpc_devices(2, ctx.work, ctx.args.threads) as (a, b):
        _run_group(ctx, check, Group(("--rpc", f"{a},{b}"), ("--rpc", f"{b},{a}"), (),
                                     ("cpu", f"RPC0[{a}]", f"RPC0[{b}]")))


CHECKS: dict[str, Callable[[Context, Check], None]] = {
    "environment": check_environment, "fit-vs-nvml": check_fit_vs_nvml,
    "pinning": check_pinning, "device-checkpoint": check_device_checkpoint,
    "sampling": check_sampling, "greedy": check_greedy, "device-rows": check_device_rows,
    "deterministic": check_deterministic,
    "service": check_service, "decode-timing": check_decode_timing, "slots": check_slots,
    "device-verify": check_device_verify, "device-draws": check_device_draws,
    "spec-targets": check_spec_targets,
    "device-group": check_device_group,
}


def render(checks: list[Check], args: argparse.Namespace) -> str:
    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"device: `{args.device}`", "", "| check | status |", "| --- | --- |"]
    lines += [f"| {c.name} | {c.status} |" for c in checks]
    for c in checks:
        lines += ["", f"## {c.name}: {c.status}", "", *[f"- {n}" for n in c.notes]]
        output = c.figures.pop("output", None)
        if c.figures:
            lines += ["", "```json", json.dumps(c.figures, indent=2, default=str), "```"]
        if output:
            lines += ["", output]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", type=Path, required=True, help="markdown report to write")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: every GPU NVML sees; cpu: the plumbing only")
    ap.add_argument("--skip", default="", help=f"comma list of checks to skip: {list(CHECKS)}")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--model", default="gemma",
                    help="fit/pinning/service model: gemma, tiny (the tiny dense) or a path")
    ap.add_argument("--jobs", type=int, default=16, help="jobs in the service batch")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per job")
    ap.add_argument("--logs", type=Path, help="keep the workers' logs in this directory")
    args = ap.parse_args()
    configure_logging(level="warning")
    skip = {s for s in args.skip.split(",") if s}
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="specfleet-gpucheck-") as tmp, \
            local_redis() as url:
        work = args.logs or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        gpus = nvml_devices() if args.device == "cuda" else []
        tiny = build_tiny_models(work)
        model = {"gemma": gemma_q4_path, "tiny": lambda: tiny.dense}.get(
            args.model, lambda: Path(args.model))()
        ctx = Context(args, work, url, model, tiny.hybrid, gpus, tiny.dense)
        for name, run in CHECKS.items():
            check = Check(name)
            checks.append(check)
            if name in skip:
                check.status = "skipped"
                continue
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            try:
                run(ctx, check)
            except Exception as exc:  # one broken check must not hide the others' results
                check.require(False, f"{type(exc).__name__}: {exc}")
            print(f"gpu_check: {name}: {check.status}", file=sys.stderr, flush=True)
    args.report.write_text(render(checks, args))
    print(json.dumps({c.name: c.status for c in checks}))
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
