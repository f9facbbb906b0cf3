"""Prometheus metrics (the reference server's names, label ``model_name``) and the per-request observer.

Each app gets its own ``CollectorRegistry`` (never the process-global one). Counting rule: a request to
a generation route counts as *received* once its handler starts, then exactly once as *success* (the
whole response or stream was delivered) or *failed* (an error status — validation errors included —,
an error event in a stream, or a client disconnect). A failed request also counts once in
``request_errors_total`` under its ``error_type`` (the one its client was sent, or ``CLIENT_GONE_TYPE``).
Token totals and the e2e/token histograms count successful requests only, so they equal the sums of the
``details`` the clients received.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from backends.types import GenerationResult, TokenEvent
from service.access_log import CLIENT_GONE
from service.vllm_metrics import HistogramAliases, engine_families, kv_usage

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model_name",)
BASE_ADAPTER = "None"  # the adapter label of base-model requests (the reference's adapter_id for none)
CLIENT_GONE_TYPE = "Client Gone"  # the error_type label of a request whose client left (no error was sent)
# Bucket ranges from the reference server (TTFT 0.001..10 s, TPOT 0.01..2.5 s, e2e 1..60 s,
# token counts 10..128000); the edges in between are ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
TOKEN_BUCKETS = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 128000)


class EngineCollector:
    """Gauges read from each model's ``backend.info()`` at scrape time: running, waiting, KV-cache usage, the
    prefix cache, speculative decoding (its counts as counters); one series per model (``model_name``)."""

    def __init__(self, engines: Iterable[tuple[str, Callable[[], dict[str, Any]]]]) -> None:
        self._engines = tuple(engines)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for name, info in self._engines:
            for family in _Engine(info(), name).collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


class _Engine:
    """One model's engine families."""

    def __init__(self, info: dict[str, Any], model_name: str) -> None:
        self._info = info
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        info = self._info
        gauges = [
            ("num_requests_running", "Requests in the running batch (prefilled, decoding).",
             info.get("running")),
            ("num_requests_waiting", "Requests queued or still prefilling.", info.get("waiting")),
            ("cpu_cache_usage_perc", "Fraction (0..1) of KV-cache blocks in use; the cache is in host memory.",
             kv_usage(info)),
            ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens admitted, since "
             "start-up.", info.get("prefix_cache_hit_rate")),
            ("prefix_cache_blocks", "KV-cache blocks findable by their hash (in use or idle).",
             info.get("prefix_cache_blocks")),
        ]
        spec = info.get("speculation") or {}
        gauges.append(("spec_decode_acceptance_rate", "Speculative decoding: accepted / drafted tokens since "
                       "start-up.", spec.get("acceptance_rate")))
        gauges.append(("spec_decode_tokens_per_verify_step", "Speculative decoding: tokens a decode row with "
                       "drafts gave, on average (accepted drafts + 1).", spec.get("tokens_per_verify_step")))
        for name, doc, value in gauges:
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=LABELS)
                family.add_metric([self._model_name], value)
                yield family
        for name, doc, key in (("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
                                "drafted_tokens"),
                               ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
                                "accepted_tokens"),
                               ("spec_decode_num_verify_steps", "Speculative decoding: decode rows that carried "
                                "drafts.", "verify_steps")):
            if spec.get(key) is not None:
                family = CounterMetricFamily(name, doc, labels=LABELS)
                family.add_metric([self._model_name], spec[key])
                yield family
        yield from self._by_priority(info.get("priorities") or {})
        yield from self._steps(info.get("steps") or {})
        yield from engine_families(info, self._model_name)  # the same figures under vLLM's names

    def _by_priority(self, priorities: dict[int, dict[str, int]]) -> Iterable[Metric]:
        """Requests per priority (a series per priority that has requests now)."""
        for where, doc in (("waiting", "Requests queued or still prefilling, per priority (lower: more urgent)."),
                           ("running", "Requests in the running batch, per priority.")):
            family = GaugeMetricFamily(f"num_requests_{where}_by_priority", doc, labels=(*LABELS, "priority"))
            for priority, counts in priorities.items():
                family.add_metric([self._model_name, str(priority)], counts[where])
            yield family

    def _steps(self, steps: dict[str, dict[str, dict[str, Any]]]) -> Iterable[Metric]:
        """The engine's steps by ``kind`` (backends/step_stats.py): their wall time and the tokens each computed."""
        if not steps:
            return
        for name, key, doc in (("engine_step_duration_seconds", "seconds", "Wall time of each engine step (plan, "
                                "forward pass, sampling), by kind: decode rows only, or with a prompt chunk."),
                               ("engine_step_tokens", "tokens", "Tokens each engine step computed (decode rows, their "
                                "drafts, prompt-chunk tokens), by kind.")):
            family = HistogramMetricFamily(name, doc, labels=(*LABELS, "kind"))
            for kind, histograms in steps.items():
                h = histograms[key]
                family.add_metric([self._model_name, kind], [*((_edge(le), n) for le, n in h["buckets"]),
                                                             ("+Inf", h["count"])], h["sum"])
            yield family


def _edge(le: float) -> str:
    """A bucket edge as Prometheus's clients write it (``0.5``, ``16.0``)."""
    return repr(float(le))


class HttpCollector:
    """The connection and admission figures at scrape time (``service/connections.py``,
    ``service/admission.py``): gauges of where requests are, counters of timeouts and refusals."""

    def __init__(self, admission: Any, connections: Any, model_name: str) -> None:
        self._admission = admission
        self._connections = connections
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        a, c = self._admission, self._connections
        gauges = [
            ("http_slots_in_use", "Generation slots in use (of maxLinkNum).", a.in_flight),
            ("http_slots_total", "Generation slots (maxLinkNum).", a.max_in_flight),
            ("http_requests_waiting_for_slot", "Requests with a complete body waiting for a slot.", a.waiting),
            ("http_requests_reading_body", "Requests whose body is still being read.", c.reading),
            ("http_body_bytes_buffered", "Body bytes held by requests reading or parsing it.", c.buffered_bytes),
            ("http_open_connections", "Open client connections.", c.open_connections),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric([self._model_name], value)
            yield family
        timeouts = CounterMetricFamily("http_timeouts", "Connections or requests ended by a timeout on what "
                                       "the client controls (header, body, keepalive, stalled_reader).",
                                       labels=(*LABELS, "kind"))
        for kind, count in sorted(c.timeouts.items()):
            timeouts.add_metric([self._model_name, kind], count)
        yield timeouts
        refused = CounterMetricFamily("http_refused", "Requests refused before their body was read "
                                      "(reading_full, buffered_full, header_too_large).", labels=(*LABELS, "reason"))
        for reason, count in sorted(c.refused.items()):
            refused.add_metric([self._model_name, reason], count)
        yield refused


class ModelLoadCollector:
    """Each model's loads and unloads (``maxLoadedModels``, ``service/models.py``): whether it is loaded, how many
    loads and unloads, and the seconds each load took."""

    def __init__(self, models: Any) -> None:
        self._models = models

    def collect(self) -> Iterable[Metric]:
        loaded = GaugeMetricFamily("model_loaded", "1 while the model is loaded and serving (0: unloaded, loading "
                                   "or draining to unload).", labels=LABELS)
        loads = CounterMetricFamily("model_loads", "Loads of the model (start-up included).", labels=LABELS)
        unloads = CounterMetricFamily("model_unloads", "Unloads of the model (maxLoadedModels: the least recently "
                                      "used idle model makes room).", labels=LABELS)
        seconds = HistogramMetricFamily("model_load_duration_seconds", "Wall time of each load of the model "
                                        "(weights, graphs, warm-up).", labels=LABELS)
        for slot in self._models.slots:
            loaded.add_metric([slot.name], 1.0 if slot.state.value == "loaded" else 0.0)
            loads.add_metric([slot.name], slot.loads)
            unloads.add_metric([slot.name], slot.unloads)
            counts = [sum(s <= le for s in slot.load_seconds) for le in LOAD_BUCKETS]
            seconds.add_metric([slot.name], [*((_edge(le), n) for le, n in zip(LOAD_BUCKETS, counts)),
                                             ("+Inf", len(slot.load_seconds))], sum(slot.load_seconds))
        yield from (loaded, loads, unloads, seconds)


LOAD_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ServiceMetrics:
    """The metrics of one server process; every app of the process shares one instance."""

    def __init__(self, model_name: str, info: Callable[[], dict[str, Any]] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        counter = self._counter
        self.received = counter("request_received_total", "Generation requests received.")
        self.success = counter("request_success_total", "Generation requests answered in full.")
        self.failed = counter("request_failed_total", "Generation requests that ended in an error or a disconnect.")
        self.errors = Counter("request_errors_total", "Failed generation requests by the error_type their client was "
                              f"sent ('{CLIENT_GONE_TYPE}': the client left).", (*LABELS, "error_type"),
                              registry=self.registry)
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of successful requests.")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens of successful requests.")
        by_adapter = (*LABELS, "adapter")  # each request once, by the LoRA adapter it ran with
        self.adapter_requests = Counter("adapter_requests_total", "Generation requests by LoRA adapter ('None': the "
                                        "base model) and outcome (success, failed).", (*by_adapter, "outcome"),
                                        registry=self.registry)
        self.adapter_prompt_tokens = Counter("adapter_prompt_tokens_total", "Prompt tokens of successful requests "
                                             "by LoRA adapter.", by_adapter, registry=self.registry)
        self.adapter_generation_tokens = Counter("adapter_generation_tokens_total", "Generated tokens of successful "
                                                 "requests by LoRA adapter.", by_adapter, registry=self.registry)
        self._histograms: list[Histogram] = []
        histogram = self._histogram
        self.ttft = histogram("time_to_first_token_seconds", "From request received to first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Gap between consecutive tokens.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Latency of successful requests.", E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                                   TOKEN_BUCKETS)
        self.registry.register(HistogramAliases(self._histograms))  # TTFT, inter-token, e2e under vLLM's names
        self._watching_http = False
        if info is not None:
            self.registry.register(EngineCollector([(model_name, info)]))

    def watch_http(self, admission: Any, connections: Any) -> None:
        """Export the gauges and counters of ``admission`` and ``connections`` (once per process)."""
        if not self._watching_http:
            self._watching_http = True
            self.registry.register(HttpCollector(admission, connections, self.model_name))

    @classmethod
    def for_backend(cls, backend: Any) -> "ServiceMetrics":
        return cls(backend.model_name, backend.info)

    @classmethod
    def for_models(cls, models: Any) -> "ServiceMetrics":
        """The metrics of a server of several models (``service/models.py``): each engine's series, and the
        loads and unloads of each model; request counters carry the first model's name."""
        metrics = cls(models.first.model_name)
        metrics.registry.register(EngineCollector((slot.name, slot.backend.info) for slot in models.slots))
        metrics.registry.register(ModelLoadCollector(models))
        return metrics

    def _counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, LABELS, registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        parent = Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets)
        self._histograms.append(parent)
        return parent.labels(self.model_name)

    def exposition(self) -> bytes:
        """The Prometheus text format of everything in this registry."""
        return generate_latest(self.registry)


class RequestObserver:
    """One generation request from received to success/failure.

    ``on_event`` runs on the engine thread (it sees every backend event as it is emitted); the other
    methods run on the event loop. ``metrics`` None keeps only the token counts (for the access log).
    """

    def __init__(self, metrics: ServiceMetrics | None) -> None:
        self._metrics = metrics
        self.started = time.perf_counter()
        self.result: GenerationResult | None = None
        self.tokens_seen = 0  # token events so far (the count a request cut short got)
        self.outcome: str | None = None  # "success" | "failed" once finished
        self._last_token: float | None = None
        self._error = False
        self._error_type: str | None = None
        self._client_gone = False
        self.adapter = BASE_ADAPTER  # the LoRA adapter it runs with, once its body is parsed
        if metrics is not None:
            metrics.received.inc()

    @property
    def prompt_tokens(self) -> int | None:
        return None if self.result is None else self.result.prompt_tokens

    @property
    def generated_tokens(self) -> int | None:
        return None if self.result is None else self.result.generated_tokens

    @property
    def tokens_generated(self) -> int | None:
        """Tokens generated for this request: the result's count, else those seen until it ended (None:
        none)."""
        if self.result is not None:
            return self.result.generated_tokens
        return self.tokens_seen or None

    def on_event(self, event: object) -> None:
        now = time.perf_counter()
        if isinstance(event, TokenEvent):
            self.tokens_seen += 1
            if self._metrics is not None:
                since = self.started if self._last_token is None else self._last_token
                (self._metrics.ttft if self._last_token is None else self._metrics.tpot).observe(now - since)
            self._last_token = now
        elif isinstance(event, GenerationResult):
            self.result = event
        else:  # a BackendError: the request failed inside the engine
            self._error = True

    def client_gone(self) -> None:
        self._client_gone = True

    def error_sent(self, error_type: str) -> None:
        """The client was sent an error of this ``error_type`` (a status, or an error event in a stream)."""
        self._error_type = error_type

    def fail(self) -> None:
        """The service gave up on the request (a timeout): it counts as failed whatever comes next."""
        self._error = True

    def finish(self, status: int) -> None:
        """Count the request once, as success or failure (``status``: the HTTP status sent)."""
        if self.outcome is not None:
            return
        ok = status < 400 and self.result is not None and not self._error and not self._client_gone
        self.outcome = "success" if ok else "failed"
        m = self._metrics
        if m is None:
            return
        m.adapter_requests.labels(m.model_name, self.adapter, self.outcome).inc()
        if not ok:
            m.failed.inc()
            gone = self._client_gone or status == CLIENT_GONE
            m.errors.labels(m.model_name, self._error_type or (CLIENT_GONE_TYPE if gone else "Unknown")).inc()
            return
        assert self.result is not None
        m.success.inc()
        m.prompt_tokens.inc(self.result.prompt_tokens)
        m.generation_tokens.inc(self.result.generated_tokens)
        m.adapter_prompt_tokens.labels(m.model_name, self.adapter).inc(self.result.prompt_tokens)
        m.adapter_generation_tokens.labels(m.model_name, self.adapter).inc(self.result.generated_tokens)
        m.request_prompt_tokens.observe(self.result.prompt_tokens)
        m.request_generation_tokens.observe(self.result.generated_tokens)
        m.e2e.observe(time.perf_counter() - self.started)
