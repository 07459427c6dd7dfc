"""Prometheus metrics of one gateway, in a registry of its own (several gateways, or tests, in one
process never share counters). Router-side figures (queue depth, in flight, live workers) are read
from the router's status at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mmfusion_http_requests", "HTTP requests by model, endpoint and status",
                                ["model", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mmfusion_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("mmfusion_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("mmfusion_time_to_first_token_seconds", "Time to the first streamed token",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mmfusion_inter_token_latency_seconds", "Time between streamed tokens", ["model"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mmfusion_e2e_request_latency_seconds", "Request time, arrival to last byte",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queued = Gauge("mmfusion_queue_depth", "Requests waiting in the router's queue, per model copy",
                            ["model"], registry=r)
        self.inflight = Gauge("mmfusion_inflight_requests", "Requests on workers, per model copy", ["model"],
                              registry=r)
        self.live_workers = Gauge("mmfusion_live_workers", "Live, loaded workers per model copy", ["model"],
                                  registry=r)
        # the workers' KV caches, summed per model copy over its live workers (from their heartbeats)
        self.kv_blocks_used = Gauge("mmfusion_kv_cache_blocks_used", "KV cache blocks held by sequences",
                                    ["model"], registry=r)
        self.kv_blocks_free = Gauge("mmfusion_kv_cache_blocks_free", "KV cache blocks free (some still cached)",
                                    ["model"], registry=r)
        self.kv_usage = Gauge("mmfusion_kv_cache_usage_ratio", "Fraction of the KV cache blocks in use", ["model"],
                              registry=r)
        self.preemptions = Gauge("mmfusion_num_preemptions", "Sequences preempted for lack of KV blocks since "
                                 "their workers started", ["model"], registry=r)
        self.prefix_queries = Gauge("mmfusion_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                    "since the workers started", ["model"], registry=r)
        self.prefix_hits = Gauge("mmfusion_prefix_cache_hits", "Prompt tokens found in the prefix cache since the "
                                 "workers started", ["model"], registry=r)
        self.prefix_hit_rate = Gauge("mmfusion_prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries",
                                     ["model"], registry=r)
        # models at run time (routing/lifecycle.py), where the deployment can load them
        self.resident = Gauge("mmfusion_model_resident_bytes", "Memory a model copy holds (its shared weights "
                              "split among their holders)", ["model"], registry=r)
        self.device_resident = Gauge("mmfusion_device_resident_bytes", "Memory the copies on a device hold",
                                     ["device"], registry=r)
        self.device_budget = Gauge("mmfusion_device_memory_budget_bytes", "The device's memory_budget", ["device"],
                                   registry=r)
        self.loads = Gauge("mmfusion_model_loads", "Copies loaded at run time since the router started", registry=r)
        self.load_failures = Gauge("mmfusion_model_load_failures", "Loads that failed", registry=r)
        self.evictions = Gauge("mmfusion_model_unloads", "Copies unloaded, by reason (unload, evicted, idle, "
                               "load_failed)", ["reason"], registry=r)
        self.load_seconds = Gauge("mmfusion_model_load_seconds_mean", "Mean seconds from a load to serving",
                                  registry=r)
        self.queue_wait = Gauge("mmfusion_model_load_queue_wait_seconds_mean", "Mean seconds requests waited for "
                                "a load", registry=r)
        # tenants (routing/tenants.py): shares and quotas
        self.tenant_inflight = Gauge("mmfusion_tenant_inflight_requests", "A tenant's requests queued or running",
                                     ["tenant"], registry=r)
        self.tenant_queued = Gauge("mmfusion_tenant_queued_requests", "A tenant's requests in the router's queues",
                                   ["tenant"], registry=r)
        self.tenant_tokens = Gauge("mmfusion_tenant_served_tokens", "Completion tokens served to a tenant since the "
                                   "router started", ["tenant"], registry=r)
        self.tenant_window = Gauge("mmfusion_tenant_tokens_last_minute", "Completion tokens served to a tenant in "
                                   "the last 60 s (its tokens_per_minute quota's window)", ["tenant"], registry=r)
        self.tenant_limited = Gauge("mmfusion_tenant_rate_limited", "A tenant's requests refused over its quotas "
                                    "(HTTP 429)", ["tenant"], registry=r)
        self.tenant_weight = Gauge("mmfusion_tenant_weight", "A tenant's weight in each model's queue", ["tenant"],
                                   registry=r)

        self._children: dict = {}  # (metric, labels) -> its child: labels() takes a lock and checks every call

    def child(self, metric, *labels: str):
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def request_done(self, model: str, endpoint: str, status: int, seconds: float | None) -> None:
        self.child(self.requests, model, endpoint, str(status)).inc()
        if seconds is not None:
            self.child(self.e2e, model).observe(seconds)

    def observe_usage(self, model: str, usage: dict) -> None:
        self.child(self.prompt_tokens, model).inc(usage.get("prompt_tokens", 0))
        self.child(self.generation_tokens, model).inc(usage.get("completion_tokens", 0))

    def router_state(self, models: list[dict], status: dict) -> None:
        if "models" in status:
            self._lifecycle(status["models"])
        for name, t in (status.get("tenants") or {}).items():
            self.tenant_inflight.labels(name).set(t["inflight"])
            self.tenant_queued.labels(name).set(t["queued"])
            self.tenant_tokens.labels(name).set(t["served_tokens"])
            self.tenant_window.labels(name).set(t["tokens_last_minute"])
            self.tenant_limited.labels(name).set(t["rate_limited"])
            self.tenant_weight.labels(name).set(t["weight"])
        for m in models:
            if m["id"] is None:
                continue  # a variant with no copy
            label = f"{m['name']}:{m['id']}"
            self.resident.labels(label).set(m.get("resident_bytes") or 0)
            ws = [w for w in status["workers"] if w["alive"] and w["model_id"] == m["id"]]
            self.live_workers.labels(label).set(sum(w["loaded"] for w in ws))
            self.inflight.labels(label).set(sum(w["inflight"] for w in ws))
            self.queued.labels(label).set(status["queued"].get(str(m["id"]), 0))
            kv = [w.get("engine") or {} for w in ws]
            total = {k: sum(e.get(k, 0) for e in kv) for k in ("blocks_used", "blocks_total", "blocks_free",
                                                                 "preemptions", "prefix_cache_queries",
                                                                 "prefix_cache_hits")}
            used, blocks = total["blocks_used"], total["blocks_total"]
            self.kv_blocks_used.labels(label).set(used)
            self.kv_blocks_free.labels(label).set(total["blocks_free"])
            self.kv_usage.labels(label).set(used / blocks if blocks else 0.0)
            self.preemptions.labels(label).set(total["preemptions"])
            queries, hits = total["prefix_cache_queries"], total["prefix_cache_hits"]
            self.prefix_queries.labels(label).set(queries)
            self.prefix_hits.labels(label).set(hits)
            self.prefix_hit_rate.labels(label).set(hits / queries if queries else 0.0)

    def _lifecycle(self, life: dict) -> None:
        for device, used in life["resident_bytes"].items():
            self.device_resident.labels(device).set(used)
        for device, budget in life["budgets"].items():
            if budget is not None:
                self.device_budget.labels(device).set(budget)
        self.loads.set(life["loads"])
        self.load_failures.set(life["load_failures"])
        for reason, n in life["evictions"].items():
            self.evictions.labels(reason).set(n)
        self.load_seconds.set(life["load_seconds"]["mean"] or 0.0)
        self.queue_wait.set(life["queue_wait_seconds"]["mean"] or 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
