"""OpenRLHF's multi-turn agent example (tests/openrlhf_f5b3f08/agent_func.py, unchanged) as `--env
tests/openrlhf_agent.py:AgentInstance`: its `from openrlhf.utils.agent import ...` answered by the stand-in in
tests/openrlhf_f5b3f08/stub/ (OpenRLHF itself is not installed)."""
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "openrlhf_f5b3f08"
if str(HERE / "stub") not in sys.path:
    sys.path.insert(0, str(HERE / "stub"))
_spec = importlib.util.spec_from_file_location("openrlhf_agent_func", HERE / "agent_func.py")
agent_func = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent_func)
AgentInstance = agent_func.AgentInstance
