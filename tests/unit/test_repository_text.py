"""The repository's text speaks about the software as it is, not about how or when it was built.

Every file `git ls-files` lists is read (binary files and generated protobuf code skipped),
and each line is searched for three kinds of history that belong in git, not in the tree:
a numbered work period ("session N", "sprint N"), an issue reference ("issue #N",
"issues/N", "GH-N", a bare "#N") and a commit hash (a 7-40 character lowercase hex word
with both letters and digits). A failure names every hit as file:line.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

WORK_PERIOD = re.compile(
    r"\b(?:session|sprint|work[ -]period)s?[ -]#?\d+\b"
    r"|\bphase \d+ of the (?:work|project|port|rewrite|refactor)\b",
    re.IGNORECASE,
)
ISSUE = re.compile(
    # "issue N" unless it is the verb ("a warp can issue 2 loads"), "issue #N", "issues #N".
    r"\bissue #?\d+\b(?!\s+(?:[a-z]+ )?(?:loads|stores|instructions|copies|reads|writes|requests|launches)\b)"
    r"|\bissues #\d+\b|\bissues/\d+\b|\bGH-\d+\b"
    # A bare "#35": not after a word character, "&" (an HTML entity) or "/" (a URL anchor).
    r"|(?<![\w&/])#\d+\b",
    re.IGNORECASE,
)
# A lowercase hex word of 7-40 characters that holds at least one letter and one digit, not
# part of a longer identifier or number (so "0x1f2e3d4c", "sha256", "v1.2.3" never match).
COMMIT_HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.])")

# Hex words that are not commit hashes. Keep this short and say what each is.
NOT_A_HASH = (
    # PTX float literals: "0f" + the 8 hex digits of an fp32 (0f00000000 is 0.0), "0d" + 16.
    re.compile(r"^0f[0-9a-f]{8}$"),
    re.compile(r"^0d[0-9a-f]{16}$"),
)

# Generated code (python -m vllm_cluster.proto.generate), not written by hand.
GENERATED = re.compile(r"^proto/.*_pb2(_grpc)?\.pyi?$")
# This file's own samples of what it rejects.
SELF = Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()


def history_mentions(line: str) -> list[str]:
    """What in `line` records how or when work was done, as short descriptions."""
    found = [f"work period {m.group(0)!r}" for m in WORK_PERIOD.finditer(line)]
    found += [f"issue reference {m.group(0)!r}" for m in ISSUE.finditer(line)]
    for m in COMMIT_HASH.finditer(line):
        word = m.group(0)
        if not any(allowed.match(word) for allowed in NOT_A_HASH):
            found.append(f"commit hash {word!r}")
    return found


def tracked_text_files() -> list[tuple[str, str]]:
    """(path, text) of every text file git tracks or would track (new files not yet added
    included, ignored ones not), but generated code and this file."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode().split("\0")
    files = []
    for path in sorted(set(filter(None, listed))):
        if GENERATED.match(path) or path == SELF:
            continue
        full = REPO_ROOT / path
        if not full.is_file():  # listed but deleted in the working tree
            continue
        data = full.read_bytes()
        if b"\0" in data:
            continue
        try:
            files.append((path, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return files


@pytest.mark.parametrize(
    "line",
    [
        # Built from pieces, so that this file does not itself hold what it forbids.
        "measured in sess" + "ion 23",
        "Sess" + "ion 22's next design",
        "over sess" + "ions 8-12",
        "done in spr" + "int 3",
        "see iss" + "ue #35",
        "iss" + "ue 10 stays open",
        "github.com/org/repo/iss" + "ues/35",
        "fixed by G" + "H-35",
        "as asked in " + "#35",
        "commit bda6b60",
        "removed after (at a3a149c)",
    ],
)
def test_history_is_flagged(line: str) -> None:
    assert history_mentions(line), line


@pytest.mark.parametrize(
    "line",
    [
        "sha256 over the parent hash and the block's token ids",
        "WIDE_N=1000000.0",
        "mask = 0x1f",
        "x = 0x4b000000",
        "mov.f32 z, 0f00000000;",
        "the session's model",  # a pytest session
        "# 35 tokens a step",  # a comment, not an issue
        "e4m3 and bf16x2",
        "each warp can issue 2 loads a step",  # the verb
        "the loop issues 4 instructions a weight",
        "deadbeef",  # hex, but no digit: a word, not a hash
        "1234567",  # digits only: a number
    ],
)
def test_clean_text_passes(line: str) -> None:
    assert history_mentions(line) == [], line


def test_repository_text_has_no_history() -> None:
    hits = [
        f"{path}:{number}: {what}"
        for path, text in tracked_text_files()
        for number, line in enumerate(text.splitlines(), start=1)
        for what in history_mentions(line)
    ]
    assert not hits, (
        "How and when work was done belongs in git history, not in the tree (docs/ STYLE habit 13). "
        "Reword or delete:\n" + "\n".join(hits)
    )
