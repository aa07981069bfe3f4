"""A stand-in (ours) for openrlhf/utils/agent.py's two base classes, which OpenRLHF's agent files subclass."""
from abc import ABC


class AgentInstanceBase(ABC):
    """An environment instance: reset(states) and step(states), async (OpenRLHF's protocol)."""


class AgentExecutorBase(ABC):
    """OpenRLHF's executor of agent instances (not used here: ppo_multiturn.py plays the episodes)."""

    def __init__(self, *args, **kwargs):
        pass
