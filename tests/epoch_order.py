"""ppo.py's `main` with `ppo_loss` wrapped to record each training step's rows and whether it trains the policy, one
line each (`RECORD {"rows": [...], "train_policy": ...}`), for tests/test_critic.py to compare with a naive loop.
Run as ppo.py is run: `python tests/epoch_order.py --output-dir DIR <ppo.py's flags>`."""
import json
import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ppo  # noqa: E402

plain_ppo_loss = ppo.ppo_loss


def recorded_ppo_loss(model, rows, r, args, pad_token_id, train_policy=True, denominators=None):
    print("RECORD " + json.dumps({"rows": rows.tolist(), "train_policy": bool(train_policy)}), flush=True)
    return plain_ppo_loss(model, rows, r, args, pad_token_id, train_policy, denominators)


ppo.ppo_loss = recorded_ppo_loss  # `main` reads the module's name when it starts
if __name__ == "__main__":
    ppo.main(tyro.cli(ppo.Args, args=sys.argv[1:]))
