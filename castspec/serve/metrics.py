"""Prometheus metrics of a castspec server. Names and meanings follow vLLM's where vLLM has one
(`vllm:num_requests_running` -> `castspec:num_requests_running`, the spec_decode counters), so dashboards carry
over; the tree-size and batch-size histograms are castspec's own.

Speculative counters, as in vLLM: a draft is one row's speculative step; draft tokens are the drafted nodes the
target verified; accepted tokens are the drafted tokens it accepted (the bonus token not counted);
accepted_tokens_per_pos counts, per depth, the steps whose accepted path reached that depth."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TREE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
PUSH_EVERY_S = 2.0  # with Ray replicas: how old another replica's series on /metrics may be (serve/ray_app.py)


disable_created_metrics()  # the *_created series only repeat the start time


class ServerMetrics:
    """One registry per server (several servers in one process, as in tests, do not collide)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"castspec:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc, extra=()):
            c = Counter(f"castspec:{name}", doc, labels + list(extra), registry=self.registry)
            return c if extra else c.labels(model_name)

        def histogram(name, doc, buckets):
            h = Histogram(f"castspec:{name}", doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.model_name = model_name
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to join the batch")
        self.kv_rows = gauge("kv_cache_rows", "Rows in the target's KV cache")
        self.kv_columns = gauge("kv_cache_columns", "Columns allocated per row in the target's KV cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = counter("request_success", "Requests finished, by reason", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token",
                              LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two outputs of a request (one per step; a step may bring several tokens)",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to the start of its prefill",
                                    LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from the start of its prefill to its first token", LATENCY_BUCKETS)
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_cache_evictions = counter("prefix_cache_evictions", "Blocks evicted from the prefix cache")
        self.prefix_cache_bytes = gauge("prefix_cache_bytes", "Bytes held by the prefix cache")
        self.prefix_cache_blocks = gauge("prefix_cache_blocks", "Blocks held by the prefix cache")
        self._prefix_seen = (0, 0, 0)  # the prefix cache's totals when last read
        self._prefix_lock = threading.Lock()
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token", LATENCY_BUCKETS)
        self.num_drafts = counter("spec_decode_num_drafts", "Speculative steps (one per row per step that drafted)")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens verified by the target")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Drafted tokens accepted by the target (bonus tokens not counted)")
        self._per_pos = Counter("castspec:spec_decode_num_accepted_tokens_per_pos",
                                "Steps whose accepted path reached this depth", labels + ["position"],
                                registry=self.registry)
        self.tree_size = histogram("tree_size", "Drafted nodes verified per row per step", TREE_BUCKETS)
        self.batch_size = histogram("batch_size", "Rows verified together per decode step", BATCH_BUCKETS)

    def observe_engine(self, engine) -> None:
        """The gauges that describe the batch as it is now."""
        self.running.set(engine.num_running)
        self.kv_rows.set(engine.target.rows)
        self.kv_columns.set(engine.target.cache.capacity)
        cache = engine.prefix_cache
        if cache is not None:  # counters follow the cache's own totals (the engine thread and /metrics both call)
            with self._prefix_lock:
                totals = (cache.queries, cache.hits, cache.evictions)
                for counter, total, seen in zip((self.prefix_cache_queries, self.prefix_cache_hits,
                                                 self.prefix_cache_evictions), totals, self._prefix_seen, strict=True):
                    counter.inc(max(0, total - seen))
                self._prefix_seen = totals
            self.prefix_cache_bytes.set(cache.nbytes)
            self.prefix_cache_blocks.set(len(cache))

    def accepted_at(self, position: int):
        return self._per_pos.labels(self.model_name, str(position))

    def observe_step(self, batch_size: int, tree_sizes: list[int], accepted: list[int]) -> None:
        """One decode step: `accepted[i]` tokens emitted by row i (bonus included) from a tree of `tree_sizes[i]`."""
        self.batch_size.observe(batch_size)
        for size, emitted in zip(tree_sizes, accepted, strict=True):
            self.tree_size.observe(size)
            if size == 0:
                continue
            self.num_drafts.inc()
            self.num_draft_tokens.inc(size)
            self.num_accepted_tokens.inc(emitted - 1)
            for depth in range(emitted - 1):
                self.accepted_at(depth).inc()
