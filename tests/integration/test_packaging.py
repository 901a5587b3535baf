"""`pip install` puts one import namespace into site-packages: `vllm_cluster` (and the
`vllm-cluster` script), nothing generic. Installed beside Hugging Face's `kernels` (which
transformers imports) and Google's `proto` (proto-plus, under every google-cloud client),
ours leaves both importable, before and after it is uninstalled again."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEIGHBOURS = ["kernels", "proto-plus"]  # the distributions whose import names (kernels, proto) ours once took


def _run(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _neighbours_importable(python: Path, cwd: Path) -> None:
    code = (
        "import kernels, proto, sysconfig; site = sysconfig.get_paths()['purelib'];"
        "assert kernels.__file__.startswith(site), kernels.__file__;"
        "assert proto.__file__.startswith(site), proto.__file__;"
        "from kernels import get_kernel; from proto import Message"
    )
    _run(python, "-c", code, cwd=cwd)


@pytest.mark.slow
def test_install_leaves_hugging_face_kernels_and_proto_plus_importable(tmp_path: Path) -> None:
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python]
    try:
        _run(*pip, "install", "-q", *NEIGHBOURS, cwd=tmp_path)
    except AssertionError as e:
        pytest.skip(f"PyPI unreachable, cannot install {NEIGHBOURS}: {str(e)[-300:]}")
    _neighbours_importable(python, tmp_path)

    # Built from a copy: setuptools builds in the source tree, and a build/ left there by an
    # earlier build would carry modules since moved into the wheel.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__"))
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, source,
         cwd=tmp_path)
    (wheel,) = wheels.glob("vllm_cluster-*.whl")
    _run(*pip, "install", "-q", "--no-deps", wheel, cwd=tmp_path)

    files = _run(*pip, "show", "-f", "vllm-cluster", cwd=tmp_path).split("Files:", 1)[1].split()
    tops = {f.split("/")[0] for f in files if not f.startswith("..")}
    assert tops == {"vllm_cluster", wheel.name.split("-py")[0] + ".dist-info"}, tops
    assert {f for f in files if f.startswith("..")} == {"../../../bin/vllm-cluster"}
    assert any(f.startswith("vllm_cluster/kernels/") for f in files)
    assert "vllm_cluster/proto/cluster.proto" in files and "vllm_cluster/proto/cluster_pb2.pyi" in files
    _neighbours_importable(python, tmp_path)
    # Ours imports too (its errors need nothing installed, torch included).
    _run(python, "-c", "import vllm_cluster.engine.errors, vllm_cluster.proto.cluster_pb2", cwd=tmp_path)

    _run(*pip, "uninstall", "-q", "-y", "vllm-cluster", cwd=tmp_path)
    _neighbours_importable(python, tmp_path)
