"""The load-testing harness behind `vllm-cluster bench serve | sweep | throughput`: datasets,
arrival processes, targets (our gRPC API or any OpenAI-compatible server), the runner, vLLM's
result keys, and plots."""
