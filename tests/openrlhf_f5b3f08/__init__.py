"""OpenRLHF's multi-turn agent example, as OpenRLHF ships it, for tests/test_multiturn.py.

agent_func.py is examples/python/agent_func.py from github.com/OpenRLHF/OpenRLHF (commit f5b3f08), unchanged (MIT:
LICENSE beside this file, OpenRLHF's). It imports `openrlhf.utils.agent`, which stub/ answers with a stand-in of ours
(the two base classes alone: OpenRLHF's module imports aiohttp, vLLM's types and its logger); ppo_multiturn.py calls
the agent as OpenRLHF's MultiTurnAgentExecutor does (openrlhf/utils/agent.py)."""
