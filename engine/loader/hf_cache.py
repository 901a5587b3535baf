"""Model ids (`org/name`) found offline in the local Hugging Face cache; never the network.

The cache is the directory `huggingface-cli download` fills, chosen as huggingface_hub
chooses it: HF_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub. A model lives under `models--{org}--{name}/`: `refs/{branch or
tag}` is a file holding a commit hash, `snapshots/{commit hash}/` the files of that
commit (symlinks into `blobs/`). A revision (ModelConfig.revision, default "main") is a
name in refs/ or a commit hash in snapshots/. The snapshot directory is the model
directory: weights, config and tokenizer all load from it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm_cluster.engine.errors import ModelLoadError

DEFAULT_REVISION = "main"
# huggingface_hub's repo id rule: an optional namespace, then the name.
_MODEL_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")


def is_model_id(name: str) -> bool:
    """Whether `name` can be a Hub model id (not a path: no leading '.', '~' or '/')."""
    return bool(_MODEL_ID.match(name)) and not name.startswith((".", "-")) and ".." not in name


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return xdg / "huggingface" / "hub"


def snapshot_dir(model_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of `model_id` at `revision`; a ModelLoadError that names every
    place looked at, and the command that fetches it, when it is not there."""
    revision = revision or DEFAULT_REVISION
    if ".." in revision or revision.startswith("/"):
        raise ModelLoadError(f"model.revision {revision!r} must be a branch, tag or commit hash")
    repo = hub_cache_dir() / f"models--{model_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    candidates = [repo / "snapshots" / revision]  # revision: a commit hash
    if ref.is_file():  # revision: a branch or tag naming a commit
        candidates.insert(0, repo / "snapshots" / ref.read_text().strip())
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    searched = [ref, *candidates]
    places = ", ".join(str(p) for p in searched)
    fetch = f"huggingface-cli download {model_id}"
    if revision != DEFAULT_REVISION:
        fetch += f" --revision {revision}"
    raise ModelLoadError(
        f"model {model_id!r} at revision {revision!r} is not a local path and is not in the Hugging Face "
        f"cache {hub_cache_dir()} (searched: {places}); download it with `{fetch}` on a machine with "
        "network access (into this cache, or set HF_HUB_CACHE to the cache that holds it)"
    )
