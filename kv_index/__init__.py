"""The cluster-wide prefix-cache index in Redis: instances publish their block events
(`BlockEventPublisher`), the router asks which instances hold a prompt's leading blocks
(`PrefixIndex`). Key layout and invariants: `kv_index.schema`."""

from vllm_cluster.kv_index.index import PrefixIndex, TierOverlap
from vllm_cluster.kv_index.publisher import BlockEventPublisher
from vllm_cluster.kv_index.redis_server import EmbeddedRedis, start_embedded_redis

__all__ = ["BlockEventPublisher", "EmbeddedRedis", "PrefixIndex", "start_embedded_redis", "TierOverlap"]
