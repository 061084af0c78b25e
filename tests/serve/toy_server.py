"""The toy engine's server (tests/serve/toy_engine.py): a plain transformers checkpoint read by transformers
itself, in float32, behind a small JSON-over-HTTP API on 127.0.0.1. Standalone: the standard library, torch
and transformers, never quantkit (an engine is another program).

Usage: toy_server.py MODEL_DIR PORT

- GET /health: 200 once the model is loaded; GET /version: {"version"};
- POST /tokenize {"text"} -> {"ids"}: the tokenizer's ids, special tokens added; with TOY_SERVER_TOKENIZE=chars
  in the environment, each character tokenized alone (a tokenizer that reads text differently);
- POST /logprobs {"ids", "k"} -> {"top": per prediction [[id, log-prob], ...] (k = 0: all), "target": the
  log-prob of the token that followed};
- POST /generate {"ids", "steps", "stream"} -> {"ids"}: the greedy continuation; with stream, one
  server-sent event per token, then `data: [DONE]`.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

VERSION = "toy-server 1"


def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def tokenize(tokenizer, text: str) -> list[int]:
    if os.environ.get("TOY_SERVER_TOKENIZE") == "chars":
        head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return head + [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    return list(tokenizer(text)["input_ids"])


@torch.no_grad()
def logprobs(model, ids: list[int], k: int) -> dict:
    rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    top = torch.topk(rows, k or rows.shape[-1], dim=-1)
    pairs = [[[int(i), float(v)] for i, v in zip(ti, tv)] for ti, tv in zip(top.indices, top.values)]
    target = [float(rows[j, ids[j + 1]]) for j in range(len(ids) - 1)]
    return {"top": pairs, "target": target}


@torch.no_grad()
def generate(model, ids: list[int], steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(token)
    return out


class Handler(BaseHTTPRequestHandler):
    model = tokenizer = None
    lock = Lock()  # one forward at a time

    def log_message(self, *args):
        pass

    def answer(self, data: dict) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.answer({"status": "ok"} if self.path == "/health" else {"version": VERSION})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            if self.path == "/tokenize":
                return self.answer({"ids": tokenize(self.tokenizer, body["text"])})
            if self.path == "/logprobs":
                return self.answer(logprobs(self.model, body["ids"], body.get("k", 0)))
            ids = generate(self.model, body["ids"], body["steps"])
        if not body.get("stream"):
            return self.answer({"ids": ids})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for token in ids:
            self.wfile.write(f"data: {json.dumps({'ids': [token]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def main():
    Handler.model, Handler.tokenizer = load(sys.argv[1])
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler).serve_forever()


if __name__ == "__main__":
    main()
