"""Packaging that pyproject.toml cannot say alone: one import namespace over the top-level folders.

Each folder at the repository root (engine/, kernels/, router/, ...) installs as
`vllm_cluster.<folder>`, so nothing generic lands in site-packages beside other projects'
`kernels` (Hugging Face's, which transformers imports) or `proto` (proto-plus). `vllm_cluster`
itself is a namespace package with no folder of its own. kernels/ and proto/ have no
`__init__.py`: run from a checkout, where the repository root is on sys.path, a folder
without one loses to an installed package of the same name, so `import kernels` still finds
Hugging Face's. Everything else (name, dependencies, scripts) is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

FOLDERS = (
    "proto", "engine", "kernels", "kv_transfer", "kv_index", "metrics", "worker",
    "prefill_service", "decode_service", "router", "client", "cluster", "loadtest",
)
NAMESPACE = "vllm_cluster"

found = find_namespace_packages(include=[f"{folder}*" for folder in FOLDERS], exclude=["*__pycache__*"])
packages = [f"{NAMESPACE}.{name}" for name in found if name.split(".")[0] in FOLDERS]

setup(
    packages=packages,
    package_dir={f"{NAMESPACE}.{folder}": folder for folder in FOLDERS},
    package_data={f"{NAMESPACE}.proto": ["*.proto", "*.pyi"]},
)
