"""Neither script imports the other, and what both need that no experiment edits lives once in ppo_harness/. So every
function or class both scripts define is part of the algorithm they share, and a copy: the same text, or one of the
differences listed here by name with its reason. A new difference fails until it is listed; a listed one that became
the same text fails until it is removed. A difference keeps the signature (the parameters, the return annotation), so
the two scripts diff line by line, unless listed in SIGNATURE_DIFFERENCES."""
import ast

import pytest

from conftest import ROOT

DIFFERENCES = {  # name: why ppo_tldr.py's differs from ppo.py's
    "PolicyAndValueWrapper": "no value head: TL;DR always trains a separate value model (N+ detail 17)",
    "Models": "TL;DR's four models: a reward model, no value head",
    "Rollout": "one reward model and no score scaling: no score components or scaled scores to keep",
    "gathered_metrics": "one reward model and no score scaling: objective/scores says it all, no per-reward means",
    "Setup": "TL;DR's own set-up record: its datasets, one tokenizer, no rewards to resolve",
    "check_args": "the TL;DR script's own flags",
    "evaluate": "TL;DR's validation: the references scored too, eval tables, SFD's metric names",
    "kl_penalty": "k1 and k3 only, the estimators --kl-estimator allows there",
    "load_models": "TL;DR's four models, no peft, value head or frozen blocks",
    "ppo_loss": "no frozen trunks, no entropy bonus and no reasoning flags (TL;DR's loss is SFD's)",
    "reference_and_values": "the reference is always its own model, no frozen trunk, and no exact KL (k1 and k3 only)",
    "reward_model_scores": "minus the score bias (N+ detail 14: the reference summaries score 0 on average)",
    "score_responses": "one reward model, on the policy's token ids",
    "set_up": "TL;DR's data, one tokenizer, no rewards to resolve",
    "value_forward": "minus the score bias the value model inherits from the reward model (N+ detail 18)",
    "policy_logits": "no frozen trunk and no value head: TL;DR trains every block of a separate value model",
    "final_hidden_states": "no frozen trunk (TL;DR trains every block), and no peft adapter to look through",
    "response_logprobs": "no frozen trunk and no value head's hidden states to hand back",
}
SIGNATURE_DIFFERENCES = {  # name: why ppo_tldr.py's parameters differ from ppo.py's (each also in DIFFERENCES)
    "Models": "TL;DR's models are named without a record of rewards (`named`)",
    "ppo_loss": "no value warm-up and no token-level denominators: the reasoning flags are ppo.py's",
    "PolicyAndValueWrapper": "no value head to take",
    "score_responses": "one reward model on the policy's token ids, not `Rewards` on the rollout's rows and step",
    "value_forward": "no `head` (TL;DR has no --shared-value-head), no frozen trunk",
    "reference_and_values": "no frozen trunks: TL;DR trains every block",
    "policy_logits": "no `trunk` or `with_hidden`: no frozen trunk, no value head",
    "final_hidden_states": "no `trunk`: TL;DR trains every block",
    "response_logprobs": "no `trunk` or `with_hidden`, and it returns (log-probs, entropies) alone",
}


def definitions(path) -> dict[str, str]:
    """Top-level functions and classes by name: their text, decorators included."""
    source = (ROOT / path).read_text()
    lines = source.splitlines()
    return {node.name: "\n".join(lines[min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1:node.end_lineno])
            for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def parameters(node: ast.FunctionDef) -> tuple[list[str], str | None]:
    """A function's parameter names in order ("*" before keyword-only ones) and its return annotation."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    names += [f"*{a.vararg.arg}"] if a.vararg else ["*"] * bool(a.kwonlyargs)
    names += [p.arg for p in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    return names, ast.unparse(node.returns) if node.returns else None


def signatures(path) -> dict[str, dict]:
    """Top-level functions and classes by name: a function's `parameters` (under its own name), a class's methods'
    (`__init__` among them) by method name."""
    signatures = {}
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, ast.FunctionDef):
            signatures[node.name] = {node.name: parameters(node)}
        elif isinstance(node, ast.ClassDef):
            signatures[node.name] = {m.name: parameters(m) for m in node.body if isinstance(m, ast.FunctionDef)}
    return signatures


PPO, TLDR = definitions("ppo.py"), definitions("ppo_tldr.py")
SHARED = sorted((set(PPO) & set(TLDR)) - {"Args", "main"})  # the two scripts' own flags and loops
PPO_SIGNATURES, TLDR_SIGNATURES = signatures("ppo.py"), signatures("ppo_tldr.py")


def test_the_scripts_share_their_helpers():
    assert len(SHARED) >= 30 and set(SIGNATURE_DIFFERENCES) <= set(DIFFERENCES) <= set(SHARED)


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_definition_is_a_copy_or_a_listed_difference(name):
    if name in DIFFERENCES:
        assert PPO[name] != TLDR[name], f"{name} is the same text in both scripts now: remove it from DIFFERENCES"
    else:
        assert PPO[name] == TLDR[name], (f"{name} differs between the scripts: make it the same text, or list it in "
                                         f"DIFFERENCES with the reason")


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_definition_has_the_same_signature_or_a_listed_reason(name):
    """The same parameter names in the same order and the same return annotation, for a function, and for each
    method that both scripts' class defines (a dataclass's fields are its own: `Setup` holds each script's set-up)."""
    ppo, tldr = PPO_SIGNATURES[name], TLDR_SIGNATURES[name]
    differ = {method: (ppo[method], tldr[method]) for method in ppo.keys() & tldr.keys() if ppo[method] != tldr[method]}
    if name in SIGNATURE_DIFFERENCES:
        assert differ, f"{name} has the same signature in both scripts now: remove it from SIGNATURE_DIFFERENCES"
    else:
        assert not differ, (f"{name}'s signature differs between the scripts (ppo.py's, ppo_tldr.py's): {differ}; "
                            "make it the same, or list it in SIGNATURE_DIFFERENCES with the reason")
