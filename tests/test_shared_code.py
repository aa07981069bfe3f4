"""No script imports another, and what they need that no experiment edits lives once in ppo_harness/. So every
function or class a sibling (ppo_tldr.py, ppo_multiturn.py) shares with ppo.py is part of the algorithm they share,
and a copy: the same text, or one of the differences listed here by name with its reason. A new difference fails
until it is listed; a listed one that became the same text fails until it is removed. A difference keeps the
signature (the parameters, the return annotation), so the scripts diff line by line, unless listed in the
sibling's SIGNATURE_DIFFERENCES."""
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
    "response_logprobs": "no frozen trunk and no value head's hidden states to hand back",
    "model_inputs": "no frozen trunk: the token ids alone",
}
SIGNATURE_DIFFERENCES = {  # name: why ppo_tldr.py's parameters differ from ppo.py's (each also in DIFFERENCES)
    "Models": "TL;DR's models are named without a record of rewards (`named`)",
    "ppo_loss": "no value warm-up and no token-level denominators: the reasoning flags are ppo.py's",
    "PolicyAndValueWrapper": "no value head to take",
    "score_responses": "one reward model on the policy's token ids, not `Rewards` on the rollout's rows and step",
    "value_forward": "no `head` (TL;DR has no --shared-value-head), no frozen trunk",
    "reference_and_values": "no frozen trunks: TL;DR trains every block",
    "policy_logits": "no `trunk` or `with_hidden`: no frozen trunk, no value head",
    "response_logprobs": "no `trunk` or `with_hidden`, and it returns (log-probs, entropies) alone",
    "model_inputs": "no `trunk`: TL;DR trains every block",
    "kl_penalty": "no `exact`: TL;DR has no exact KL (k1 and k3 only)",
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


MULTITURN_DIFFERENCES = {  # name: why ppo_multiturn.py's differs from ppo.py's
    "Rollout": "episodes: a mask of the policy's tokens, the turns and how each episode ended; no reward components",
    "Setup": "the environment and the context's limit; no rewards to resolve",
    "Models": "no reward models",
    "check_args": "the multi-turn script's own flags",
    "set_up": "the environment loaded and tried, rows instead of tokenised prompts, the context's limit",
    "load_models": "no reward models, no kept trunk (each turn re-encodes its context) and no compiled step",
    "compute_rewards": "each turn's reward at its last action token, not one score after the response",
    "loss_denominators": "the action tokens alone: no dynamic sampling or positive examples",
    "ppo_loss": "the losses on the policy's tokens alone; no critic-free estimators or positive-example loss",
    "gathered_metrics": "the turns' metrics (turns, observation tokens, truncated episodes); no reward components",
    "evaluate": "held-out episodes, the environments' own draws seeded and put back",
}
MULTITURN_SIGNATURE_DIFFERENCES = {
    "Models": "no record of rewards to name models by (`named`)",
    "compute_rewards": "the turns' rewards per token, not a score per response at its sequence length",
    "ppo_loss": "one denominator (the action tokens'), not the token and positive-example pair",
    "gathered_metrics": "the pad id (observation tokens are the response's other real tokens), no `args`",
    "evaluate": "the held-out rows are the set-up's: no queries to pass",
}
SIBLINGS = {"ppo_tldr.py": (DIFFERENCES, SIGNATURE_DIFFERENCES),
            "ppo_multiturn.py": (MULTITURN_DIFFERENCES, MULTITURN_SIGNATURE_DIFFERENCES)}
PPO, PPO_SIGNATURES = definitions("ppo.py"), signatures("ppo.py")
SIBLING_DEFINITIONS = {path: definitions(path) for path in SIBLINGS}
SIBLING_SIGNATURES = {path: signatures(path) for path in SIBLINGS}
# each sibling's own flags and loop aside
SHARED = [(path, name) for path in SIBLINGS for name in sorted((set(PPO) & set(SIBLING_DEFINITIONS[path]))
                                                              - {"Args", "main"})]


@pytest.mark.parametrize("path", SIBLINGS)
def test_the_scripts_share_their_helpers(path):
    differences, signature_differences = SIBLINGS[path]
    shared = {name for p, name in SHARED if p == path}
    assert len(shared) >= 30 and set(signature_differences) <= set(differences) <= shared


@pytest.mark.parametrize("path,name", SHARED)
def test_a_shared_definition_is_a_copy_or_a_listed_difference(path, name):
    sibling = SIBLING_DEFINITIONS[path][name]
    if name in SIBLINGS[path][0]:
        assert PPO[name] != sibling, f"{name} is the same text in ppo.py and {path} now: remove it from its DIFFERENCES"
    else:
        assert PPO[name] == sibling, (f"{name} differs between ppo.py and {path}: make it the same text, or list it "
                                      f"in {path}'s DIFFERENCES with the reason")


@pytest.mark.parametrize("path,name", SHARED)
def test_a_shared_definition_has_the_same_signature_or_a_listed_reason(path, name):
    """The same parameter names in the same order and the same return annotation, for a function, and for each
    method that both scripts' class defines (a dataclass's fields are its own: `Setup` holds each script's set-up)."""
    ppo, sibling = PPO_SIGNATURES[name], SIBLING_SIGNATURES[path][name]
    differ = {m: (ppo[m], sibling[m]) for m in ppo.keys() & sibling.keys() if ppo[m] != sibling[m]}
    if name in SIBLINGS[path][1]:
        assert differ, f"{name} has the same signature in ppo.py and {path} now: remove it from SIGNATURE_DIFFERENCES"
    else:
        assert not differ, (f"{name}'s signature differs between ppo.py and {path}: {differ}; make it the same, or "
                            "list it in SIGNATURE_DIFFERENCES with the reason")
