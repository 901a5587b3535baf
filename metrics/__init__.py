"""Prometheus metrics with vLLM's names (`vllm:`), plus the disaggregation's own
(`vllm_cluster:`): the router's per request (router.py), each instance's (instance.py).
Each owns a CollectorRegistry, never the process-global one."""

from vllm_cluster.metrics.instance import InstanceMetrics
from vllm_cluster.metrics.router import RequestMetrics, RouterMetrics

__all__ = ["InstanceMetrics", "RequestMetrics", "RouterMetrics"]
