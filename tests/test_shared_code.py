"""The two scripts stand alone (neither imports the other), so every function they both define is a copy: the same
text, or a different text on purpose, with a `# differs from ppo.py` comment in ppo_tldr.py saying why."""
import ast

import pytest

from conftest import ROOT


def definitions(path) -> dict[str, str]:
    """Top-level functions and classes by name: their text, with the line above them (where a comment may stand)."""
    source = (ROOT / path).read_text()
    lines = source.splitlines()
    return {node.name: "\n".join(lines[node.lineno - 2:node.end_lineno])
            for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


PPO, TLDR = definitions("ppo.py"), definitions("ppo_tldr.py")
SHARED = sorted((set(PPO) & set(TLDR)) - {"Args", "main"})  # the two scripts' own flags and loops


def test_the_scripts_share_their_helpers():
    assert len(SHARED) >= 30


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_function_is_a_copy_or_says_why_not(name):
    ppo_text, tldr_text = (PPO[name].split("\n", 1)[1], TLDR[name].split("\n", 1)[1])  # without the line above
    if ppo_text != tldr_text:
        assert "differs from ppo.py" in TLDR[name], f"{name} differs between the scripts without a comment saying why"
