"""The two scripts stand alone (neither imports the other), so every function or class they both define is a copy:
the same text, or one of the differences listed here by name with its reason. A new difference fails until it is
listed; a listed one that became the same text fails until it is removed."""
import ast

import pytest

from conftest import ROOT

DIFFERENCES = {  # name: why ppo_tldr.py's differs from ppo.py's
    "PolicyAndValueWrapper": "TL;DR's forward returns the policy's logits and the values: no fused head, value head or "
                             "speed layer",
    "RunLog": "the tokenizer saved with the run, TL;DR's console line, wandb.log (no TensorBoard sync)",
    "Models": "TL;DR's four models: a reward model, no value head or forwards",
    "Setup": "TL;DR's own set-up record: its datasets, one tokenizer, no rewards to resolve",
    "check_args": "the TL;DR script's own flags",
    "evaluate": "TL;DR's validation: the references scored too, eval tables, SFD's metric names",
    "final_hidden_states": "no peft",
    "generate": "always response_length wide (SFD: the last score past eos)",
    "kl_penalty": "k1 and k3 only, the estimators --kl-estimator allows there",
    "load_models": "TL;DR's four models, no peft, value head or speed layer",
    "reference_and_values": "whole models, no full KL, always the values",
    "reward_model_scores": "minus the score bias (N+ detail 14: the reference summaries score 0 on average)",
    "save_models": "no adapters, no value head",
    "score_responses": "one reward model, on the policy's token ids",
    "set_up": "TL;DR's data, one tokenizer, no rewards to resolve",
    "value_forward": "minus the score bias the value model inherits from the reward model (N+ detail 18)",
}


def definitions(path) -> dict[str, str]:
    """Top-level functions and classes by name: their text, decorators included."""
    source = (ROOT / path).read_text()
    lines = source.splitlines()
    return {node.name: "\n".join(lines[min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1:node.end_lineno])
            for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


PPO, TLDR = definitions("ppo.py"), definitions("ppo_tldr.py")
SHARED = sorted((set(PPO) & set(TLDR)) - {"Args", "main"})  # the two scripts' own flags and loops


def test_the_scripts_share_their_helpers():
    assert len(SHARED) >= 30 and set(DIFFERENCES) <= set(SHARED)


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_definition_is_a_copy_or_a_listed_difference(name):
    if name in DIFFERENCES:
        assert PPO[name] != TLDR[name], f"{name} is the same text in both scripts now: remove it from DIFFERENCES"
    else:
        assert PPO[name] == TLDR[name], (f"{name} differs between the scripts: make it the same text, or list it in "
                                         f"DIFFERENCES with the reason")
