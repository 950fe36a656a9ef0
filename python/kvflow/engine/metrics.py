"""Prometheus metrics, named as vLLM names them (with the kvflow: prefix).

Engine-wide numbers (queue sizes, KV usage, token and request counters) are read from
LLMEngine.stats() when Prometheus scrapes, so they can never drift from the engine's own count;
per-request latencies go into histograms when a request finishes."""

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvflow.engine.outputs import RequestOutput

# Seconds; the same spirit as vLLM's buckets, spanning a fast GPU and a two-core CPU.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0)


class _EngineStatsCollector:
    def __init__(self, stats, model_name: str):
        self._stats = stats
        self._model_name = model_name

    def collect(self):
        stats = self._stats()
        labels = [self._model_name]

        def gauge(name, documentation, value):
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name, documentation, value):
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("kvflow:num_requests_running", "Requests in model execution batches.", stats["running"])
        yield gauge("kvflow:num_requests_waiting", "Requests waiting to be scheduled.", stats["waiting"])
        yield gauge("kvflow:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of the blocks in use.",
                    stats["kv_usage"])
        yield counter("kvflow:prompt_tokens", "Prompt tokens admitted.", stats["prompt_tokens"])
        yield counter("kvflow:generation_tokens", "Tokens generated.", stats["generated_tokens"])
        yield counter("kvflow:num_preemptions", "Requests preempted (their blocks freed, to be recomputed).",
                      stats["preemptions"])
        yield counter("kvflow:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats["prompt_tokens"])
        yield counter("kvflow:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
                      stats["cached_prompt_tokens"])
        yield counter("kvflow:model_step_failures", "Model steps that failed (their requests were aborted).",
                      stats["step_failures"])
        spec = stats.get("spec_decode")
        if spec is not None:
            yield counter("kvflow:spec_decode_num_drafts", "Speculative verifications (request steps with drafts).",
                          spec["num_drafts"])
            yield counter("kvflow:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec["num_draft_tokens"])
            yield counter("kvflow:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          spec["num_accepted_tokens"])
            per_position = CounterMetricFamily("kvflow:spec_decode_num_accepted_tokens_per_pos",
                                               "Draft tokens accepted, by position in the draft.",
                                               labels=["model_name", "position"])
            for position, count in enumerate(spec["accepted_per_position"]):
                per_position.add_metric([self._model_name, str(position)], count)
            yield per_position
        finished = CounterMetricFamily("kvflow:request_success", "Finished requests, by finish reason.",
                                       labels=["model_name", "finished_reason"])
        for reason, count in stats["finished_requests"].items():
            finished.add_metric([self._model_name, reason], count)
        yield finished


class EngineMetrics:
    """A registry with the engine's gauges and counters and the per-request latency histograms;
    call observe_finished() with each finished RequestOutput."""

    def __init__(self, stats, model_name: str, registry: CollectorRegistry | None = None):
        """stats: a callable returning LLMEngine.stats()'s dict."""
        self.registry = registry or CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name))

        def histogram(name, documentation, buckets):
            return Histogram(name, documentation, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model_name)

        self.ttft = histogram("kvflow:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.tpot = histogram("kvflow:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", _TOKEN_BUCKETS)
        self.itl = histogram("kvflow:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             _TOKEN_BUCKETS)
        self.e2e = histogram("kvflow:e2e_request_latency_seconds", "Arrival to finish, per request.",
                             _REQUEST_BUCKETS)
        self.queue_time = histogram("kvflow:request_queue_time_seconds", "Arrival to first scheduled, per request.",
                                    _REQUEST_BUCKETS)

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        for value, histogram in ((m.ttft, self.ttft), (m.tpot, self.tpot), (m.e2e, self.e2e),
                                 (m.queue_time, self.queue_time)):
            if value is not None:
                histogram.observe(value)
        for gap in m.itls:
            self.itl.observe(gap)
