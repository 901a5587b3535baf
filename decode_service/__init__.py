"""The decode instance: a decode-role engine behind the DecodeWorker gRPC API. It reserves
blocks for prompts, receives their KV from prefill instances, and decodes them with
continuous batching (servicer.py has the request's lifecycle). Run it with
`python -m vllm_cluster.decode_service --config ...`; `vllm-cluster up` does."""
