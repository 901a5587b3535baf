"""The shell the cluster's servers share: the process main of a prefill or decode instance
(engine, engine loop, KV transport, prefix-index publisher, metrics, gRPC server), the gRPC
plumbing (servers with health, reflection and the cluster-token check; channels), the
conversions between protobuf messages and engine types, LoRA admin, and the router's
settings (so that cluster/ validates a whole YAML without importing a service).

Importing this package imports nothing heavy; `worker.main` and `worker.convert` load the
engine.
"""
