"""Runs OpenRLHF's reward server, tests/openrlhf_58ec6ff/serve_rm.py, unchanged, with its imports answered by small
stand-ins: FastAPI and uvicorn by a plain HTTP server that calls its `/get_reward` handler, OpenRLHF's model loader by a
scorer whose score is a query's token count (its attention mask's sum, plus 0.001 a padding token), OpenRLHF's
tokenizer loader by transformers'.

    python tests/openrlhf_server.py --reward_pretrain TOKENIZER_DIR --port PORT
"""
import asyncio
import json
import logging
import runpy
import sys
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from transformers import AutoTokenizer


class App:  # FastAPI(): routes registered by @app.post(path)
    def __init__(self):
        self.routes = {}

    def post(self, path):
        def register(handler):
            self.routes[path] = handler
            return handler
        return register


class Request:  # fastapi.Request: the body, as JSON
    def __init__(self, body: bytes):
        self.body = body

    async def json(self):
        return json.loads(self.body)


class JSONResponse:  # fastapi.responses.JSONResponse
    def __init__(self, content):
        self.content = content


def run(app, host, port, log_level):  # uvicorn.run: a handler's exception is a 500, as uvicorn answers it
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                reply, status = asyncio.run(app.routes[self.path](Request(body))).content, 200
            except Exception:
                reply, status = "Internal Server Error", 500
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer((host, port), Handler).serve_forever()


class TokenCounter(torch.nn.Module):  # get_llm_for_sequence_regression(...)
    """A query's score is its token count, plus 0.001 a padding token: as a real model in bf16, a row padded in a
    batch scores slightly unlike alone."""
    device = torch.device("cpu")

    def forward(self, input_ids, attention_mask):
        return attention_mask.sum(1).float() + 1e-3 * (attention_mask == 0).sum(1)


def get_tokenizer(pretrain, model, padding_side, strategy, use_fast=True):  # as OpenRLHF's: pad = eos if none
    tokenizer = AutoTokenizer.from_pretrained(pretrain, use_fast=use_fast)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


modules = {
    "uvicorn": dict(run=run), "fastapi": dict(FastAPI=App, Request=Request),
    "fastapi.responses": dict(JSONResponse=JSONResponse), "openrlhf": {},
    "openrlhf.models": dict(get_llm_for_sequence_regression=lambda *args, **kwargs: TokenCounter()),
    "openrlhf.utils": dict(get_tokenizer=get_tokenizer),
    "openrlhf.utils.logging_utils": dict(init_logger=logging.getLogger),
}
for name, attributes in modules.items():
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
sys.argv[0] = "serve_rm.py"
runpy.run_path(str(Path(__file__).parent / "openrlhf_58ec6ff" / "serve_rm.py"), run_name="__main__")
