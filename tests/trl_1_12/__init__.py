"""TRL 1.12.0's reward functions, as TRL ships them, for tests/test_trl_rewards.py.

rewards/accuracy_rewards.py is trl/rewards/accuracy_rewards.py from the trl-1.12.0 wheel on PyPI, unchanged (Apache-2.0:
its header, and LICENSE beside this file, TRL's). Its one import from the rest of TRL, `..import_utils`, is answered by
import_utils.py here, ours. Run with tests/ on PYTHONPATH: --reward-fn trl_1_12.rewards.accuracy_rewards:accuracy_reward
"""
