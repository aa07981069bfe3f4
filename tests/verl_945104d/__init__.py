"""verl's GSM8K scorer, as verl ships it, for tests/test_reward_stacks.py.

gsm8k.py is verl/utils/reward_score/gsm8k.py from github.com/volcengine/verl (commit 945104d), unchanged (Apache-2.0:
its header, and LICENSE beside this file, the Apache License 2.0 with verl's copyright line)."""
