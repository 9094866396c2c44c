"""The project lints clean with pyproject.toml's [tool.ruff], and every noqa says which rule and why.

A ``# noqa`` is allowed only as ``# noqa: CODE[, CODE] - reason``: the rule it silences, and the
reason the code is right anyway (RUF100, in the ruff run, finds those that silence nothing).
"""

from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Not the project's code: toolchains, build output (hidden folders: .venv, .venv-checkov, .git, caches).
NOT_OURS = {"node_modules", "cdk.out", "cdk.out.staging", "dist"}
NOQA = re.compile(r"#[^#]*\bnoqa\b", re.IGNORECASE)
WELL_FORMED = re.compile(r"# noqa: [A-Z]+[0-9]+(?:, [A-Z]+[0-9]+)* - \S.*")


def bad_noqa_comments(source: str) -> list[tuple[int, str]]:
    """(line, comment) for each comment with a noqa not of the form ``# noqa: CODE[, CODE] - reason``."""
    bad = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        found = NOQA.search(token.string) if token.type == tokenize.COMMENT else None
        if found and not WELL_FORMED.fullmatch(token.string[found.start():].rstrip()):
            bad.append((token.start[0], token.string))
    return bad


def project_python_files() -> list[Path]:
    return [path for path in sorted(REPO.rglob("*.py"))
            if not any(part.startswith(".") or part in NOT_OURS for part in path.relative_to(REPO).parts[:-1])]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed in this environment (requirements-dev.txt installs it)")
def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_noqa_names_its_rules_and_says_why():
    files = project_python_files()
    assert REPO / "training" / "loop" / "trainer.py" in files and not any("node_modules" in f.parts for f in files)
    bad = [f"{path.relative_to(REPO)}:{line}: {comment}" for path in files
           for line, comment in bad_noqa_comments(path.read_text())]
    assert not bad, "a noqa must read `# noqa: CODE[, CODE] - reason`:\n" + "\n".join(bad)


@pytest.mark.parametrize("line", [
    "import os  # noqa\n",
    "import os  # noqa: F401\n",
    "import os  # noqa: F401 -\n",
    "import os  # noqa: F401 reason without the dash\n",
    "import os  # noqa:F401 - no space\n",
    "import os  # NOQA: F401 - capitals\n",
    "import os  # noqa: F401,E402 - no space after the comma\n",
    "import os  # used elsewhere  # noqa: F401\n",
    "# ruff: noqa: F401\n",
])
def test_a_noqa_without_its_rule_or_reason_is_found(line):
    assert [number for number, _ in bad_noqa_comments(line)] == [1]


@pytest.mark.parametrize("line", [
    "import os  # noqa: F401 - imported for its side effect\n",
    "x = 1  # noqa: E501, W291 - a table, aligned\n",
    "x = 1  # why, in words  # noqa: SIM115 - closed in close()\n",
    'x = "# noqa"  # a string, not a comment\n',
    "x = 1  # an ordinary comment\n",
])
def test_a_noqa_with_its_rules_and_reason_passes(line):
    assert bad_noqa_comments(line) == []
