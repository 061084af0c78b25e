"""A stand-in for an engine's server, for the launcher tests: stdlib HTTP on 127.0.0.1.

Usage: stub_server.py PORT [--delay S] [--fail] [--never] [--ignore-term] [--child PIDFILE]

- GET /health answers 200 once --delay seconds have passed (503 before);
- --fail: print a traceback-like cause and exit 1 before listening; --never: never answer 200;
- --ignore-term: ignore SIGTERM (the launcher must SIGKILL it);
- --child PIDFILE: start a grandchild (sleep) in the same process group and write its pid there;
- POST /completion: llama-server's shape. With n_probs: two candidates; with stream: `n_predict` events
  of one token each, 10 ms apart.
- POST /tokenize: TOKENIZED's ids of the text, in llama-server's shape ({"content", "add_special",
  "parse_special"} -> {"tokens"}) or vLLM's ({"model", "prompt", "add_special_tokens"} -> {"tokens", "count",
  "max_model_len"}); a request without those fields is answered 400.
"""

import json
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START = time.monotonic()
TOKENIZED = {"Hello world": [1, 15043, 3186], "x": [1, 29916]}
LLAMA_TOKENIZE = {"content", "add_special", "parse_special"}
VLLM_TOKENIZE = {"model", "prompt", "add_special_tokens"}


def arg(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        ready = "--never" not in sys.argv and time.monotonic() - START >= float(arg("--delay", 0))
        self.send_response(200 if ready else 503)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}' if ready else b'{"status": "loading"}')

    def send_json(self, answer: dict, status: int = 200):
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def tokenize(self, body: dict):
        if set(body) == LLAMA_TOKENIZE and body["add_special"] and body["parse_special"]:
            return self.send_json({"tokens": TOKENIZED[body["content"]]})
        if set(body) == VLLM_TOKENIZE and body["add_special_tokens"]:
            ids = TOKENIZED[body["prompt"]]
            return self.send_json({"tokens": ids, "count": len(ids), "max_model_len": 128})
        return self.send_json({"error": {"message": f"unexpected fields {sorted(body)}"}}, 400)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self.tokenize(body)
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(body.get("n_predict", 4)):
                time.sleep(0.01)
                self.wfile.write(f"data: {json.dumps({'tokens': [i], 'stop': False})}\n\n".encode())
                self.wfile.flush()
            return
        candidates = [{"id": 5, "logprob": -0.5}, {"id": 7, "logprob": -1.5}][: body.get("n_probs", 2)]
        answer = {"tokens": [5] * body.get("n_predict", 1),
                  "completion_probabilities": [{"id": 5, "logprob": -0.5, "top_logprobs": candidates}]}
        self.send_json(answer)


def main():
    port = int(sys.argv[1])
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if arg("--child"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(arg("--child"), "w") as fh:
            fh.write(str(child.pid))
    print("stub: loading the model", flush=True)
    if "--fail" in sys.argv:
        print("Traceback (most recent call last):\nValueError: stub cannot load this format", flush=True)
        sys.exit(1)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
