"""butter's engine state under the Prometheus names vLLM exports, for the routers that
read them: the vLLM production-stack router and the Gateway API inference extension's
endpoint picker (llm-d). docs/scale-out.md says which consumer reads which series.

Same names, types and labels as vLLM (`vllm/v1/metrics/loggers.py`: every series has
`model_name`, the served model id, and `engine`, the engine index, "0" here), and the same
meaning where butter has the quantity:

- running / waiting requests: admitted to a session / waiting for admission;
- KV cache usage: the fraction of the KV pool reserved by live requests. Like vLLM's
  free-but-cached blocks, idle sessions' cached prefixes do not count: they are evicted
  on demand;
- prefix cache queries / hits: prompt tokens / prompt tokens reused from the cache, in
  tokens as vLLM counts them, added when a request finishes.

Read from the resident engine at scrape time, like butter's own series (metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from butter.pipeline.resident import ResidentModel

# butter's KV cache has no blocks: prefixes are reused token by token. The endpoint
# picker's prefix scorer still wants a block size to hash prompts by (from
# `vllm:cache_config_info`); vLLM's default keeps its index as coarse as for vLLM, and
# num_gpu_blocks = KV cells / 16 gives it the pool's real capacity in tokens.
VLLM_BLOCK_SIZE = 16
ENGINE_INDEX = "0"  # one engine per butter process

Family = CounterMetricFamily | GaugeMetricFamily


class VllmCollector(Collector):
    def __init__(self, resident: Callable[[], ResidentModel | None]) -> None:
        self._resident = resident

    def collect(self) -> Iterator[Family]:
        resident = self._resident()
        if resident is None:  # between a swap's unload and load: nothing to report
            return
        stats = resident.engine.stats()
        labels = {"model_name": resident.model_id, "engine": ENGINE_INDEX}
        usage = stats.reserved_cells / stats.total_cells if stats.total_cells else 0.0
        gauges = {
            "vllm:num_requests_running": ("Requests admitted to a generation session",
                                          stats.active),
            "vllm:num_requests_waiting": ("Requests waiting for admission", stats.queued),
            "vllm:kv_cache_usage_perc": ("KV-cache usage: the fraction of the pool reserved "
                                         "by live requests. 1 means 100 percent.", usage),
            "vllm:gpu_cache_usage_perc": ("KV-cache usage (vLLM's name before 0.9). "
                                          "1 means 100 percent.", usage),
        }
        for name, (text, value) in gauges.items():
            yield _gauge(name, text, labels, value)
        counters = {
            "vllm:prefix_cache_queries": ("Prefix cache queries, in prompt tokens",
                                          stats.prompt_tokens),
            "vllm:prefix_cache_hits": ("Prefix cache hits, in prompt tokens reused",
                                       stats.cached_tokens),
            "vllm:gpu_prefix_cache_queries": ("Prefix cache queries, in prompt tokens "
                                              "(vLLM's name before 0.9)", stats.prompt_tokens),
            "vllm:gpu_prefix_cache_hits": ("Prefix cache hits, in prompt tokens reused "
                                           "(vLLM's name before 0.9)", stats.cached_tokens),
        }
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(name, text, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            yield family
        yield self._cache_config(resident, stats.total_cells)

    @staticmethod
    def _cache_config(resident: ResidentModel, cells: int) -> GaugeMetricFamily:
        """An info series (a gauge at 1), as vLLM emulates Prometheus info metrics."""
        info = {
            "block_size": str(VLLM_BLOCK_SIZE),
            "num_gpu_blocks": str(cells // VLLM_BLOCK_SIZE),
            "cache_dtype": resident.backend.kv_type.name,
            "enable_prefix_caching": "True",
            "engine": ENGINE_INDEX,
        }
        return _gauge("vllm:cache_config_info", "Information of the KV cache configuration",
                      info, 1)


def _gauge(name: str, text: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family
