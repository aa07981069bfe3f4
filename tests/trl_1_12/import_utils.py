"""Ours: what trl/import_utils.py answers accuracy_rewards.py (whether math_verify can be imported)."""
import importlib.util


def is_math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None
