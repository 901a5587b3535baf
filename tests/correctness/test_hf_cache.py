"""A model id (`org/name`) loads offline from a Hugging Face cache laid out as
`huggingface-cli download` leaves it: refs/ naming commits, snapshots/ of symlinks into
blobs/. Weights, config and tokenizer all come from the snapshot the revision picks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.loader import resolve
from vllm_cluster.engine.loader.hf_cache import hub_cache_dir, snapshot_dir

MODEL_ID = "tiny-org/tiny-llama"
MAIN = "a" * 40  # the commit refs/main names
TAGGED = "b" * 40  # the commit refs/v1 names
_WORDS = ["[UNK]", "<s>", "</s>", *[f"w{i}" for i in range(61)]]


def _checkpoint(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=len(_WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("checkpoint")
    _checkpoint(path)
    return path


@pytest.fixture
def cache(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache huggingface_hub would leave: two commits, main and tag v1, files as
    symlinks into blobs/."""
    hub = tmp_path / "hub"
    repo = hub / f"models--{MODEL_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "blobs").mkdir()
    for ref, commit in (("main", MAIN), ("v1", TAGGED)):
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in checkpoint.iterdir():
            blob = repo / "blobs" / f"{commit[:4]}-{file.name}"
            shutil.copyfile(file, blob)
            (snapshot / file.name).symlink_to(blob)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return repo


def test_cache_directory_follows_huggingface_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path("~/.cache/huggingface/hub").expanduser()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_revision_picks_the_snapshot(cache: Path) -> None:
    assert snapshot_dir(MODEL_ID) == cache / "snapshots" / MAIN
    assert snapshot_dir(MODEL_ID, "main") == cache / "snapshots" / MAIN
    assert snapshot_dir(MODEL_ID, "v1") == cache / "snapshots" / TAGGED  # a tag in refs/
    assert snapshot_dir(MODEL_ID, TAGGED) == cache / "snapshots" / TAGGED  # a commit hash


def test_missing_model_names_id_revision_places_and_command(cache: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        LLM("tiny-org/absent", revision="v2", device="cpu")
    message = str(info.value)
    repo = cache.parent / "models--tiny-org--absent"
    for part in (
        "'tiny-org/absent'", "revision 'v2'", str(repo / "refs" / "v2"), str(repo / "snapshots" / "v2"),
        "huggingface-cli download tiny-org/absent --revision v2",
    ):
        assert part in message


def test_missing_revision_of_a_cached_model(cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="revision 'nope'.*huggingface-cli download tiny-org/tiny-llama"):
        snapshot_dir(MODEL_ID, "nope")


def test_yaml_model_id_resolves_to_the_snapshot(cache: Path) -> None:
    config = EngineConfig.from_dict({"model": {"model": MODEL_ID, "revision": "v1"}, "device": "cpu"})
    source = resolve(config.model)
    assert source.path == cache / "snapshots" / TAGGED
    assert source.tokenizer_path == source.path
    assert source.hf_config["vocab_size"] == len(_WORDS)


def test_revision_with_a_local_path_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a local path: unset revision"):
        resolve(EngineConfig.from_kwargs(str(checkpoint), revision="main").model)


def test_llm_loads_by_id_as_from_its_directory(cache: Path, checkpoint: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", num_blocks=16, block_size=4)
    by_id = LLM(MODEL_ID, **options)
    assert by_id.core.source.path == cache / "snapshots" / MAIN
    assert Path(by_id.tokenizer.name_or_path) == cache / "snapshots" / MAIN
    by_hash = LLM(MODEL_ID, revision=MAIN, **options)
    assert by_hash.core.source.path == by_id.core.source.path
    by_path = LLM(str(checkpoint), **options)

    prompt = "w3 w17 w42 w5"
    expected = by_path.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    for llm in (by_id, by_hash):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == by_path.tokenizer(prompt)["input_ids"]
        assert out.outputs[0].token_ids == expected.token_ids
        assert out.outputs[0].text == expected.text
