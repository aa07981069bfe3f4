"""A reward model served over HTTP, for `ppo.py --reward-fn http://HOST:PORT/score` (README: "A reward over HTTP").

    python benchmarks/reward_server.py --reward-model-path Skywork/Skywork-Reward-V2-Qwen3-0.6B --port 8000 &
    python ppo.py --reward-fn http://127.0.0.1:8000/score ...

It answers ppo.py's POST (a JSON object with the keywords a reward function gets: prompts, completions, ...) with
{"rewards": [one score per row]}. It reads each row as ppo.py reads a reward model with its own tokenizer: chat
completions as an assistant turn rendered by the reward model's chat template (continuing a final assistant prefix),
text as prompt + completion (TRL's GRPOTrainer), its score at the last real token (`ppo_harness.reward_models.text_reward_scores`). Standard
library only, besides ppo.py's own requirements; GET answers "ok" once the model is loaded.
"""
import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ppo_harness import tokenizers  # noqa: E402
from ppo_harness.prompt_files import as_messages  # noqa: E402
from ppo_harness.reward_models import text_reward_scores  # noqa: E402


def rendered(tokenizer, prompts: list, completions: list) -> list[str]:
    """The texts the reward model reads: a chat with the completion as its assistant answer, or prompt + completion."""
    if not isinstance(completions[0], list):
        return [p + c for p, c in zip(prompts, completions)]
    # a completion already holds the prompt's final assistant prefix: it replaces that message
    messages = [as_messages(p) for p in prompts]
    return [tokenizer.apply_chat_template(m[:-1] + c if m[-1]["role"] == "assistant" else m + c, tokenize=False)
            for m, c in zip(messages, completions)]


class Scorer:
    def __init__(self, path: str, batch_size: int, device: str, trust_remote_code: bool):
        self.path, self.batch_size, self.device = path, batch_size, device
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, trust_remote_code=trust_remote_code).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.max_length = min(filter(None, [getattr(config, "max_position_embeddings", None), (
            self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1e9 else None)]), default=None)
        self.lock = threading.Lock()  # one batch at a time on the model

    def __call__(self, request: dict) -> list[float]:
        chat = isinstance(request["completions"][0], list)
        tokenizer = tokenizers.prepare_reward_tokenizer(self.tokenizer, self.path, chat)
        texts = rendered(tokenizer, request["prompts"], request["completions"])
        with self.lock, torch.no_grad():
            return torch.cat([text_reward_scores(self.model, tokenizer, texts[i:i + self.batch_size],
                                                     self.max_length, not chat, self.device)
                              for i in range(0, len(texts), self.batch_size)]).tolist()


def serve(scorer: Scorer, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def answer(self, status: int, body: dict | str):
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer(200, "ok")

        def do_POST(self):
            try:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.answer(200, {"rewards": scorer(request)})
            except Exception as e:  # ppo.py retries a 5xx, then stops naming this server
                self.answer(500, f"{type(e).__name__}: {e}")

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer((host, port), Handler)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward-model-path", required=True, help="a sequence classifier (num_labels=1)")
    parser.add_argument("--host", default="127.0.0.1", help="127.0.0.1: this machine only; 0.0.0.0: every network")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per forward")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args()
    server = serve(Scorer(args.reward_model_path, args.batch_size, args.device, args.trust_remote_code), args.host,
                   args.port)
    print(f"serving {args.reward_model_path} at http://{args.host}:{args.port}/score", flush=True)
    server.serve_forever()
