"""ppo.py's `main` with `ppo_loss` wrapped to record each training step's rows and whether it trains the policy, one
line each (`RECORD {"rows": [...], "train_policy": ...}`), and each update's rollout as phases 1-5 left it, once
(`ROLLOUT {...}`: the fields tests/test_ppo.py's phase-4 test reads), for tests to compare with naive loops. Run as
ppo.py is run: `python tests/epoch_order.py --output-dir DIR <ppo.py's flags>`."""
import json
import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ppo  # noqa: E402

plain_ppo_loss = ppo.ppo_loss


ROLLOUT_FIELDS = ("responses", "sequence_lengths", "padding_mask", "padding_mask_p1", "kl", "rewards", "advantages",
                  "trained_scores", "kl_coef")
last = [None]  # the rollout recorded last


def recorded_ppo_loss(model, rows, r, args, pad_token_id, train_policy=True, denominators=None):
    if r is not last[0]:  # the first training step of an update
        last[0] = r
        fields = {name: getattr(r, name).tolist() for name in ROLLOUT_FIELDS}
        print("ROLLOUT " + json.dumps({**fields, "unjudged": r.score_components.unjudged.tolist(),
                                       "pad_token_id": pad_token_id}), flush=True)
    print("RECORD " + json.dumps({"rows": rows.tolist(), "train_policy": bool(train_policy)}), flush=True)
    return plain_ppo_loss(model, rows, r, args, pad_token_id, train_policy, denominators)


ppo.ppo_loss = recorded_ppo_loss  # `main` reads the module's name when it starts
if __name__ == "__main__":
    ppo.main(tyro.cli(ppo.Args, args=sys.argv[1:]))
