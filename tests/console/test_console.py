"""The web console (``GET /console``) in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium) against a live fleet behind an API key.

The fleet: ``chat`` (the tiny dense chat model, model ``tiny``), ``hyb`` (the tiny hybrid with
MTP, N=5 > D=1 so deep rejections replay, and its device checkpoint forced to fail: a host
fallback at start-up; model ``hybrid``), ``victim`` (model ``victim``, killed with SIGKILL
by one test) and ``gone`` (model ``gone``, stopped at once: a model with no worker, whose batch
lines wait). Each test reads the page as a person would and checks it against the fleet
itself: ``/metrics``, ``specfleet top --once --json``, the jobs' own telemetry, the gateway's
API. The browser's log must hold no error but the one a refused cancel is meant to cause.

With ``SPECFLEET_CONSOLE_SCREENSHOTS=DIR`` each panel is saved as ``DIR/console-NAME.png`` (the
screenshots of docs/operations.md: ``SPECFLEET_CONSOLE_SCREENSHOTS=docs/img``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from gateway.conftest import deployment_settings
from gateway.gateway import Gateway
from helpers import specfleet, wait_for
from monitor.scrape import total
from redis import Redis
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select
from service.conftest import _delete_namespace
from service.workers import Fleet

from coordinator.client import Coordinator
from coordinator.metrics import fleet_snapshot
from shared.results import JobResult
from shared.settings import Settings
from worker.testmodels import TinyModels
from worker.testmodels.tiny import write_dense_llama

KEY = "console-test-key"
HYBRID_ARGS = ("--ctx", "512", "--spec", "mtp", "--draft-max", "5", "--rollback-depth", "1",
               "--model-name", "hybrid")
PROMPTS = ["Tell me a story.", "Count to ten.", "What is a fleet?"]
T = TypeVar("T")


@dataclass
class Live:
    settings: Settings
    fleet: Fleet
    gateway: Gateway
    #: The jobs run on ``tiny`` and ``hybrid`` before any test, by model.
    results: dict[str, list[JobResult]]

    @property
    def url(self) -> str:
        return self.gateway.url

    def api(self, method: str, path: str, key: str | None = KEY, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kwargs)


@pytest.fixture(scope="module")
def live(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    settings = deployment_settings("con")
    logs = tmp_path_factory.mktemp("console")
    chat = write_dense_llama(logs / "tiny-chat.gguf", chat=True)
    fleet = Fleet(settings, chat, logs)
    gateway = Gateway(settings, logs, env={"SPECFLEET_API_KEYS": KEY})
    try:
        fleet.start("chat", wait=False)
        fleet.start("victim", wait=False, args=("--ctx", "512", "--model-name", "victim"))
        fleet.start("gone", wait=False, args=("--ctx", "512", "--model-name", "gone"))
        fleet.model = tiny_models.hybrid
        fleet.start("hyb", wait=False, args=HYBRID_ARGS,
                    extra_env={"SPECFLEET_FAIL_DEVICE_CHECKPOINT": "1"})
        gateway.start()
        for name in ("chat", "victim", "hyb", "gone"):
            fleet.wait_registered(name)
        # a model known to the fleet with no worker now: its batch lines wait for one
        fleet.kill("gone", signal.SIGTERM)
        assert fleet.procs["gone"].wait(timeout=30) == 0
        coordinator = Coordinator(settings)
        handles = {model: [coordinator.submit({"model": model, "max_tokens": 48,
                                               "messages": [{"role": "user", "content": p}]})
                           for p in PROMPTS] for model in ("tiny", "hybrid")}
        results = {m: [h.result(timeout=120) for h in hs] for m, hs in handles.items()}
        generated = {w: sum(r.telemetry.generated_tokens for rs in results.values() for r in rs
                            if r.worker == w and r.telemetry) for w in ("chat", "hyb")}

        def published() -> bool:
            rows = {w.name: w for w in fleet_snapshot(coordinator).workers}
            return all(w in rows and rows[w].generated_tokens == n
                       for w, n in generated.items())
        wait_for(published, 30, "heartbeats carrying the jobs' telemetry")
        yield Live(settings, fleet, gateway, results)
    finally:
        gateway.stop()
        fleet.stop_all()
        _delete_namespace(Redis.from_url(settings.redis_url), settings.prefix)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver; "
                    ".ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,900", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver path is given: selenium never looks for (or downloads) one itself
    drv = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture
def page(browser: WebDriver, live: Live) -> Iterator[Page]:
    """The browser on the console; afterwards, its log must hold no error (but those the
    test said it expects)."""
    browser.get_log("browser")  # what earlier tests left
    page = Page(browser, live)
    yield page
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
              and not any(expected(e["message"]) for expected in page.expected_errors)]
    assert errors == [], errors


class Page:
    def __init__(self, driver: WebDriver, live: Live) -> None:
        self.driver = driver
        self.live = live
        self.expected_errors: list[Callable[[str], bool]] = []

    def open(self, fragment: str, key: str | None = None) -> None:
        """Load the console at ``#fragment`` holding ``key`` (None: no key)."""
        self.driver.get(f"{self.live.url}/console#{fragment}")
        self.driver.execute_script(
            "arguments[0] ? sessionStorage.setItem('specfleet.apiKey', arguments[0])"
            " : sessionStorage.removeItem('specfleet.apiKey');", key)
        self.driver.refresh()  # the page reads the key as it starts

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def wait(self, script: str, what: str, timeout: float = 30, *args: Any) -> Any:
        """Until ``script`` returns something truthy in the page; that is the result (a
        timeout shows what the page said meanwhile)."""
        try:
            return wait_for(lambda: self.js(script, *args), timeout, what, every=0.1)
        except AssertionError as exc:
            shown = self.js("return document.querySelector('main').innerText")
            logs = self.driver.get_log("browser")
            raise AssertionError(f"{exc}\npage:\n{shown[:3000]}\nbrowser log: {logs}") from None

    def rows(self, table: str, key: str) -> dict[str, dict[str, str]]:
        """Each row of ``#table`` by its ``data-KEY``: its cells' raw ``data-value``s."""
        return self.js("""
            const out = {};
            for (const tr of document.querySelectorAll(`#${arguments[0]} tbody tr`)) {
              const row = {};
              for (const td of tr.querySelectorAll('td[data-field]'))
                row[td.dataset.field] = td.dataset.value;
              out[tr.dataset[arguments[1]]] = row;
            }
            return out;""", table, key)

    def click(self, selector: str) -> None:
        """Click the element ``selector`` finds (found again if the page re-drew it between
        the finding and the click: a live table does)."""
        for _ in range(5):
            try:
                self.driver.find_element(By.CSS_SELECTOR, selector).click()
                return
            except StaleElementReferenceException:
                continue
        raise AssertionError(f"{selector} kept being re-drawn")

    def screenshot(self, name: str) -> None:
        folder = os.environ.get("SPECFLEET_CONSOLE_SCREENSHOTS")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            assert self.driver.save_screenshot(str(Path(folder) / f"console-{name}.png"))


def test_the_fleet_page_shows_what_metrics_and_top_show(page: Page) -> None:
    live = page.live
    page.open("fleet")
    snapshot = fleet_snapshot(Coordinator(live.settings)).to_json()
    want = {w["name"]: w["generated_tokens"] for w in snapshot["workers"]}

    def shown() -> dict[str, dict[str, str]] | None:
        rows = page.rows("workers", "worker")
        got = {name: int(row["generated_tokens"]) for name, row in rows.items()}
        return rows if got == want else None
    rows = wait_for(shown, 30, "the page's workers as the fleet snapshot has them")
    top = json.loads(specfleet("top", "--once", "--json",
                               env=live.fleet.env(0.0, {}), timeout=60).stdout)
    assert {w["name"] for w in top["workers"]} == set(rows) >= {"chat", "hyb"}
    for w in top["workers"]:
        row = rows[w["name"]]
        for field in ("model", "device", "checkpoint_mode"):
            assert row[field] == (w[field] or ""), (w["name"], field)
        for field in ("n_ctx", "busy_slots", "host_fallbacks", "generated_tokens",
                      "acceptance", "tokens_per_second", "prefix_hit_rate"):
            assert float(row[field]) == w[field], (w["name"], field)
        assert float(row["tokens_per_verify"]) == w["telemetry"]["tokens_per_verify"]
    hyb = {w["name"]: w for w in top["workers"]}["hyb"]
    assert hyb["checkpoint_mode"] == "host" and hyb["acceptance"] > 0
    queues = page.rows("queues", "queue")
    assert set(queues) == {f"{q['model']}|{q['tier']}" for q in top["queues"]}
    for q in top["queues"]:  # idle: every queue empty, on the page as in top
        row = queues[f"{q['model']}|{q['tier']}"]
        assert (row["model"], row["tier"], row["priority"]) == (
            q["model"], q["tier"], "high" if q["tier"] == "high" or q["tier"].endswith(":high")
            else "normal")
        assert int(row["depth"]) == q["depth"] == 0
        assert float(row["oldest_wait_seconds"]) == q["oldest_wait_seconds"] == 0
    metrics = httpx.get(live.url + "/metrics", timeout=30).text
    slots = page.js("return Object.fromEntries([...document.querySelectorAll("
                    "'#workers tbody tr')].map(tr => [tr.dataset.worker, +tr.dataset.slots]));")
    assert slots == {w["name"]: w["slots"] for w in top["workers"]}
    for model in ("tiny", "hybrid", "victim"):
        served = [r for r in rows.values() if r["model"] == model]
        assert total(metrics, "specfleet:workers_live", model=model) == len(served)
        assert total(metrics, "specfleet:fleet_busy_slots", model=model) == sum(
            int(r["busy_slots"]) for r in served)
        assert total(metrics, "specfleet:fleet_slots", model=model) == sum(
            slots[name] for name, r in rows.items() if r["model"] == model)
        assert total(metrics, "specfleet:queue_depth", model=model) == sum(
            int(q["depth"]) for q in queues.values() if q["model"] == model)
    for name, row in rows.items():
        assert total(metrics, "specfleet:worker_telemetry_generated_tokens_total",
                     worker=name) == int(row["generated_tokens"])
    page.screenshot("fleet")


def test_a_worker_page_shows_its_fit_acceptance_and_replays(page: Page) -> None:
    page.open("worker/hyb")
    (hyb,) = [w for w in fleet_snapshot(Coordinator(page.live.settings)).workers
              if w.name == "hyb"]
    t = hyb.telemetry or {}
    assert t["replay_events"] >= sum(r.telemetry.replay_events for r in
                                     page.live.results["hybrid"] if r.telemetry) > 0
    page.wait("return document.querySelector('#worker-summary').textContent"
              ".includes(arguments[0])", "the worker's replays in its summary", 30,
              f"{t['replay_events']} replays ({t['replay_tokens']} tokens)")
    fit = page.js("return Object.fromEntries([...document.querySelectorAll('#fit tr')]"
                  ".map(tr => [tr.dataset.fit, tr.querySelector('td').textContent]));")
    assert fit["checkpoint_fallback"] == "fault_injection"
    assert fit["checkpoint_mode"] == "host"
    assert fit["slots"] == "1" and fit["speculation"].startswith("mtp, N=5, D=1")
    charts = page.js("return [...document.querySelectorAll('#tab-worker .chart')]"
                     ".map(c => c.querySelectorAll('canvas').length);")
    assert charts == [1, 1, 1, 1]
    page.screenshot("worker")


def test_the_events_timeline_shows_the_host_fallback_and_the_replays(page: Page) -> None:
    page.open("events")
    page.wait("return document.querySelector('#events tbody tr[data-kind=fallback]')",
              "a fallback on the timeline")
    Select(page.driver.find_element(By.ID, "filter-worker")).select_by_value("hyb")
    shown = page.js("return [...document.querySelectorAll('#events tbody tr')].map(tr => "
                    "[tr.dataset.kind, tr.dataset.worker, tr.cells[4].textContent]);")
    assert {worker for _, worker, _ in shown} == {"hyb"}
    fallbacks = [what for kind, _, what in shown if kind == "fallback"]
    assert fallbacks == ["checkpoints moved to the host (reserve: fault_injection)"]
    replayed = {r.job_id: r.telemetry.replay_events for r in page.live.results["hybrid"]
                if r.telemetry and r.telemetry.replay_events}
    rows = {what.split(":")[0]: what.split(",")[0] for kind, _, what in shown
            if kind == "replay"}  # (the playground's jobs too, when it ran first)
    assert {f"job {job}": rows.get(f"job {job}") for job in replayed} == {
        f"job {job}": f"job {job}: {n} replay(s)" for job, n in replayed.items()}
    Select(page.driver.find_element(By.ID, "filter-kind")).select_by_value("fallback")
    assert page.js("return [...document.querySelectorAll('#events tbody tr')]"
                   ".map(tr => tr.dataset.kind);") == ["fallback"]
    Select(page.driver.find_element(By.ID, "filter-kind")).select_by_value("")
    page.screenshot("events")


def _batch(live: Live, lines: list[dict[str, Any]]) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = live.api("POST", "/v1/files", files={"file": ("in.jsonl", content)},
                      data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    created = live.api("POST", "/v1/batches", json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def _line(custom_id: str, model: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 8,
                     "messages": [{"role": "user", "content": custom_id}], **body}}


def test_batches_progress_open_and_cancel_only_with_the_key(page: Page) -> None:
    live = page.live
    done = _batch(live, [_line(f"ok-{i}", "tiny") for i in range(3)]
                  + [_line("bad", "tiny", temperature=9)])
    stuck = _batch(live, [_line(f"wait-{i}", "gone") for i in range(2)])  # no worker now
    page.open("batches", key=KEY)
    page.wait("const tr = document.querySelector(`#batches tr[data-batch='${arguments[0]}']`);"
              "return tr && tr.dataset.status === 'completed'"
              " && tr.querySelector('[data-field=progress]').dataset.value === '100.0';",
              "the batch's progress bar at 100%", 60, done)
    row = page.rows("batches", "batch")[done]
    assert row["counts"] == "3/1/4" and row["eta"] == "-"
    assert page.js("return document.querySelector(`#batches tr[data-batch='${arguments[0]}'] "
                   "progress`).value", done) == 100
    page.click(f"#batches tr[data-batch='{done}'] a")
    failed = page.wait("const rows = [...document.querySelectorAll('#batch-errors tbody tr"
                       "[data-line]')]; return rows.length && rows.map(tr => "
                       "[...tr.cells].map(td => td.textContent));", "the failed lines")
    assert len(failed) == 1 and failed[0][1] == "bad" and "temperature" in failed[0][3]

    # without the key the console still shows the batch, and the gateway refuses its cancel
    page.expected_errors.append(lambda m: f"/v1/batches/{stuck}/cancel" in m and "401" in m)
    page.click("#key-forget")
    page.click(f"button.cancel[data-batch='{stuck}']")
    refused = page.wait("const m = document.querySelector('#batch-message').textContent;"
                        "return m.includes('refused') && m;", "the refusal")
    assert "(401)" in refused and "API key" in refused
    assert live.api("GET", f"/v1/batches/{stuck}").json()["status"] in ("validating",
                                                                          "in_progress")
    page.screenshot("batches")
    # with it, the same button cancels through the same API
    page.driver.find_element(By.ID, "api-key").send_keys(KEY)
    page.click("#key-use")
    page.wait("return document.querySelector(`button.cancel[data-batch='${arguments[0]}']`)",
              "the listing again, with the key", 30, stuck)
    page.click(f"button.cancel[data-batch='{stuck}']")
    page.wait("return document.querySelector('#batch-message').textContent"
              ".includes(': cancel')", "the cancel")
    assert live.api("GET", f"/v1/batches/{stuck}").json()["status"] in ("cancelling",
                                                                          "cancelled")


def test_the_playground_streams_a_reply_and_marks_drafted_tokens(page: Page) -> None:
    page.open("playground", key=KEY)
    page.wait("return document.querySelector('#pg-model option[value=hybrid]')",
              "the served models")
    Select(page.driver.find_element(By.ID, "pg-model")).select_by_value("hybrid")
    page.click("#pg-send")
    page.wait("return document.querySelector('#pg-reply').dataset.done === 'true'",
              "the streamed reply", 60)
    reply = page.js("return document.querySelector('#pg-reply').textContent")
    tokens = page.js("return [...document.querySelectorAll('#pg-tokens .tok')]"
                     ".map(s => [s.dataset.origin, s.textContent]);")
    assert reply and reply == "".join(text for _, text in tokens)
    origins = "".join(origin for origin, _ in tokens)
    assert set(origins) <= {"d", "t"} and "d" in origins and "t" in origins
    job = page.js("return document.querySelector('#pg-reply').dataset.job")
    final = Coordinator(page.live.settings).handle(job).result(timeout=10)
    assert final.telemetry is not None and len(tokens) == final.telemetry.generated_tokens
    # every verify's own token is one target decode; each drafted one was accepted
    assert origins.count("t") <= final.telemetry.target_decodes
    assert origins.count("d") <= final.telemetry.accepted
    marked = page.js("return document.querySelector('#pg-telemetry "
                     "[data-telemetry^=marked] td').textContent")
    assert marked == f"{origins.count('d')} / {origins.count('t')} / 0"
    page.screenshot("playground")


def test_a_killed_worker_shows_as_lost(page: Page) -> None:
    live = page.live
    page.open("fleet")
    page.wait("return document.querySelector('#workers tr[data-worker=victim]')",
              "the victim, live")
    killed = time.monotonic()
    live.fleet.kill("victim", signal.SIGKILL)
    page.wait("return document.querySelector('#lost tr[data-lost=victim]')",
              "the victim shown lost", 30)
    seen = time.monotonic() - killed
    print(f"victim shown lost {seen:.2f} s after SIGKILL "
          f"(TTL {live.settings.worker_ttl_seconds} s)")
    page.wait("return document.querySelector('#lost tr[data-lost=victim][data-state=lost]')",
              "the victim declared lost by a sweep", 30)
    assert page.js("return document.querySelector('#workers tr[data-worker=victim]')") is None
    page.js("document.querySelector('#lost').scrollIntoView()")
    page.screenshot("lost")
