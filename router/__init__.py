"""The router, the cluster's front door: the client gRPC API and the OpenAI-compatible HTTP
API (openai/), the instance registry with health and load polling, the pure routing
policies (policy.py), admission, the per-request hand-off state machine (handoff.py) and
migration. servicer.py has the request's lifecycle. Run it with
`python -m vllm_cluster.router --config ...`; `vllm-cluster up` does."""
