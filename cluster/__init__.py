"""The `vllm-cluster` command (cli.py): the YAML schema with file:line errors, `up`, `down`,
`status`, `logs`, placement of instances on Ray, the embedded Redis, and the cluster as
local processes for tests (local.py)."""
