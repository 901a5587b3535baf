"""The prefill instance: a prefill-role engine behind the PrefillWorker gRPC API. It computes
prompts (chunked, batched) and pushes their KV, layer by layer, into blocks a decode
instance reserved (servicer.py has the request's lifecycle). Run it with
`python -m vllm_cluster.prefill_service --config ...`; `vllm-cluster up` does."""
