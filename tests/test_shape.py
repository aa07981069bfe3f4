"""The project's floors, measured on the scripts as shipped (the versions git's HEAD holds, where there is a git
checkout): an edit made in place is never failed here, and a copy is not measured at all. Size is read as a reader
reads it: lines, with a statement split over lines where it is long (at most a tenth of a file's lines over 100
columns, so nothing is merged to save lines), and prose (full-line comments and docstrings) at most a third of a
script's characters (a reference, not a manual). ppo.py holds every feature in at most 1,746 lines (1,700 when the
page was made plain, 20 the critic's own lr and epochs added, 13 --push-to-hub's flags and the truncation marker, 13
the lr schedule's own record, the compile cache checked before peft's import and --fused-lm-head's flag) and its
`main` in at most 200; ppo_multiturn.py in 1,510; `generate` is the plain sampling loop, at most 20 lines; no
function of a script takes a speed choice as a parameter (the README's ledger: a hand-written speed path is a
wrapper named at one line of `main`); the harness keeps to 100 columns on nine lines in ten; the README at most 312
lines (300, 10 for the multi-turn sibling's section, 2 for the critic's ablation), benchmarks/README.md 350 (300, 30
for the multi-turn task, 10 for the default run measured with the page's own LM head against the hand-written one, 5
for the critic's ablation rows, 3 for the throughput bench with --fused-lm-head, 2 for the walk's cut measured against
the code before it)."""
import ast
import io
import json
import os
import subprocess
import sys
import tokenize

import pytest

from conftest import ROOT

# script: (lines, lines of `main`); ppo.py: 1,700 for the plain page's features, + 20 for --critic-learning-rate,
# --critic-epochs and the warm-up that waits, + 13 for --push-to-hub's flags (--hub-strategy's 3 of them) and the
# truncation marker, + 7 for the lr schedule's record (the warm-up's Adam reset found again by a resume that
# shortened it; an lr written outside the schedule refused), + 3 for the harness imported before peft (a compile
# cache folder that cannot be made, refused by name), + 3 for --fused-lm-head (the ledger's LM head, off by default);
# ppo_multiturn.py, the multi-turn sibling: 1,500 (its own rollout and credit assignment beside ppo.py's core,
# without ppo.py's reward stack and reasoning flags), + 7, + 3 and + 3 (--hub-strategy) as ppo.py's
LIMITS = {"ppo.py": (1_746, 200), "ppo_tldr.py": (1_150, 160), "ppo_multiturn.py": (1_510, 160)}
# parameter names that would thread a speed choice through the page (what the ledger's wrappers replaced)
SPEED_PARAMETERS = {"shortcuts", "kept", "keep", "fused_head", "static", "static_step", "pieces", "fast_paths"}


def shipped(path: str) -> str:
    """The file as HEAD holds it (an edit in the working tree is the editor's), else as it is on disk."""
    proc = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 and proc.stdout else (ROOT / path).read_text()


def characters(text: str) -> int:
    """Non-whitespace characters: what a reader reads, however the lines are broken."""
    return sum(not c.isspace() for c in text)


def function(source: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)


def lines_of(node: ast.FunctionDef) -> int:
    """A function's lines from its `def` to its last line (decorators not counted)."""
    return node.end_lineno - node.lineno + 1


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


def speed_parameters(source: str) -> dict[str, set[str]]:
    """Each function (methods too) that has a parameter named in SPEED_PARAMETERS, with those parameters."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            a = node.args
            names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs} & SPEED_PARAMETERS
            if names:
                found[node.name] = names
    return found


def test_the_measures_count_what_they_say():
    source = '"""A module."""\n# why\n\n\ndef main(args, fused_head=False):\n    x = 1  # not a full-line comment\n' + \
             "    for update in range(3):\n        y = 2\n        z = 3\n    return x\n"
    assert characters("a b\n\tc ") == 3
    assert lines_of(function(source, "main")) == 6
    assert prose_share(source) == pytest.approx((len('"""Amodule."""') + len("#why")) / characters(source))
    assert speed_parameters(source) == {"main": {"fused_head"}}


@pytest.mark.parametrize("script", sorted(LIMITS))
def test_the_shipped_script_stays_within_the_floors(script):
    source = shipped(script)
    lines, (most, most_in_main) = source.splitlines(), LIMITS[script]
    assert len(lines) <= most, f"{script}: {len(lines)} lines (at most {most})"
    assert lines_of(function(source, "main")) <= most_in_main, f"{script}: main has {lines_of(function(source, 'main'))}"
    assert lines_of(function(source, "generate")) <= 20, f"{script}: generate is not the plain loop"
    assert not speed_parameters(source), f"{script}: speed threaded through the page: {speed_parameters(source)}"
    share = sum(len(line) > 100 for line in lines) / len(lines)
    assert share <= 0.10, f"{script}: {share:.1%} of its lines are over 100 columns (at most 10%)"
    assert prose_share(source) <= 1 / 3, f"{script}: prose is {prose_share(source):.1%} of its characters"


def test_the_harness_keeps_to_100_columns_on_nine_lines_in_ten():
    """Statements split, comments wrapped: never merged, never a sentence shortened to fit."""
    lines = [line for path in sorted((ROOT / "ppo_harness").glob("*.py")) for line in path.read_text().splitlines()]
    over = sum(len(line) > 100 for line in lines)
    assert over <= 0.1 * len(lines), f"{over} of the harness's {len(lines)} lines are over 100 columns"


def test_the_walk_from_the_update_loop_to_the_first_optimizer_step_is_35_functions_in_4_files():
    """tests/walk.py's trace of the default run on tiny models (the working tree's ppo.py): at most 35 functions in
    at most 4 files (tests/README.md lists them), and no hand-written autograd among them: the training step's
    backward is torch's, of the page's own forward."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "walk.py"), "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    walk = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ("ppo.py", "ppo_loss") in map(tuple, walk["walk"]) and ("ppo.py", "generate") in map(tuple, walk["walk"])
    assert len(walk["walk"]) <= 35 and len(walk["files"]) <= 4, walk
    assert not any(name.endswith(".backward") for _, name in walk["walk"]), walk


# the README: 300, + 10 for ppo_multiturn.py's section (the rest of its guide is docs/multiturn.md), + 2 for the
# critic's ablation; the benchmarks: 300, + 30 for its task's measurements, + 10 for the default run with the page's own
# LM head against the hand-written one, + 5 for the critic's ablation rows (the lambdas, plain PPO again), + 3 for the
# throughput bench with --fused-lm-head, + 2 for the walk's cut measured against the code before it
@pytest.mark.parametrize("document, most", [("README.md", 312), ("benchmarks/README.md", 350)])
def test_documents_stay_within_their_length(document, most):
    assert len(shipped(document).splitlines()) <= most
