"""OpenRLHF's reward server, as OpenRLHF ships it, for tests/test_reward_stacks.py.

serve_rm.py is openrlhf/cli/serve_rm.py from github.com/OpenRLHF/OpenRLHF (commit 58ec6ff), unchanged (MIT: LICENSE
beside this file, OpenRLHF's). tests/openrlhf_server.py runs it with its imports answered by small stand-ins (ours):
FastAPI and uvicorn by a plain HTTP server, OpenRLHF's model loader by a scorer that counts a query's tokens."""
