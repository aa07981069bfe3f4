"""The project's floors, measured on the scripts as shipped (the versions git's HEAD holds, where there is a git
checkout): an edit made in place is never failed here, and a copy is not measured at all. Size is counted in
characters, not lines, so that splitting a long line costs nothing: ppo.py at most 90,000 non-whitespace characters
and ppo_tldr.py 55,000, their `main` 12,500 and 9,000; at most 10% of a script's lines over 100 columns; prose
(full-line comments and docstrings) at most a third of its characters (a reference, not a manual); the README and
benchmarks/README.md at most 300 lines."""
import ast
import io
import subprocess
import tokenize

import pytest

from conftest import ROOT

# script: (non-whitespace characters, of them in `main`)
LIMITS = {"ppo.py": (90_000, 12_500), "ppo_tldr.py": (55_000, 9_000)}


def shipped(path: str) -> str:
    """The file as HEAD holds it (an edit in the working tree is the editor's), else as it is on disk."""
    proc = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 and proc.stdout else (ROOT / path).read_text()


def characters(text: str) -> int:
    """Non-whitespace characters: what a reader reads, however the lines are broken."""
    return sum(not c.isspace() for c in text)


def main_source(source: str) -> str:
    main = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return "\n".join(source.splitlines()[main.lineno - 1:main.end_lineno])


def prose_share(source: str) -> float:
    """The share of non-whitespace characters in full-line comments and docstrings (Args' field docstrings too)."""
    lines, prose = source.splitlines(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose.update(range(node.lineno, node.end_lineno + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip().startswith("#"):
            prose.add(token.start[0])
    return sum(characters(lines[i - 1]) for i in prose) / characters(source)


def test_the_measures_count_what_they_say():
    source = '"""A module."""\n# why\n\n\ndef main(args):\n    x = 1  # not a full-line comment\n' + \
             "    for update in range(3):\n        y = 2\n        z = 3\n    return x\n"
    assert characters("a b\n\tc ") == 3
    assert main_source(source).splitlines()[0] == "def main(args):" and main_source(source).endswith("return x")
    assert prose_share(source) == pytest.approx((len('"""Amodule."""') + len("#why")) / characters(source))


@pytest.mark.parametrize("script", ["ppo.py", "ppo_tldr.py"])
def test_the_shipped_script_stays_within_the_floors(script):
    source = shipped(script)
    lines, (most, most_in_main) = source.splitlines(), LIMITS[script]
    assert characters(source) <= most, f"{script}: {characters(source)} characters (at most {most})"
    assert characters(main_source(source)) <= most_in_main, f"{script}: main has {characters(main_source(source))}"
    share = sum(len(line) > 100 for line in lines) / len(lines)
    assert share <= 0.10, f"{script}: {share:.1%} of its lines are over 100 columns (at most 10%)"
    assert prose_share(source) <= 1 / 3, f"{script}: prose is {prose_share(source):.1%} of its characters"


@pytest.mark.parametrize("document, most", [("README.md", 300), ("benchmarks/README.md", 300)])
def test_documents_stay_within_their_length(document, most):
    assert len(shipped(document).splitlines()) <= most
