"""The quick check after an edit (about a minute on 2 CPU cores): each script, or an edited copy of it, trains two
short runs on tiny models, one through the speed layer and one with --no-fast-paths, and they agree update by
update (a copier's edited forward switches the shortcuts off, so the two still agree).

    HF_HUB_OFFLINE=1 python -m pytest tests/test_quick.py -q -p no:cacheprovider
    PPO_SCRIPT=my_ppo.py PPO_TLDR_SCRIPT=my_ppo_tldr.py HF_HUB_OFFLINE=1 python -m pytest tests/test_quick.py -q

A copy lives beside the original, where it finds ppo_harness/."""
import math
import os

import pytest

from conftest import assert_same_run, run_ppo, tiny_args
from test_tldr import tiny_args as tldr_args
from test_tldr import tldr  # noqa: F401 (the TL;DR fixture: tiny models with a biased reward model, posts)

SCRIPTS = {"ppo": os.environ.get("PPO_SCRIPT", "ppo.py"), "tldr": os.environ.get("PPO_TLDR_SCRIPT", "ppo_tldr.py")}


@pytest.mark.parametrize("kind", ["ppo", "tldr"])
def test_a_short_run_trains_through_the_speed_layer_as_through_the_plain_forwards(request, assets, tmp_path, kind):
    if kind == "ppo":
        args = tiny_args(assets, "--eval-samples", "4", "--num-trainable-layers", "1", "--shared-value-head")
    else:
        args = tldr_args(request.getfixturevalue("tldr"), "--total-episodes", "32")
    fast, fast_rows = run_ppo(args, tmp_path / "fast", script=SCRIPTS[kind])
    plain, plain_rows = run_ppo([*args, "--no-fast-paths"], tmp_path / "plain", script=SCRIPTS[kind])
    assert len(fast_rows) == 2 and all(math.isfinite(v) for r in fast_rows for v in r.values()
                                       if isinstance(v, float))
    assert (tmp_path / "fast" / "model.safetensors").exists() and "fast paths: off" in plain.stdout
    assert_same_run(plain_rows, fast_rows, rel=1e-4)
