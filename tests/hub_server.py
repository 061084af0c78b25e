"""Hub-compatible servers on 127.0.0.1 for the tests (nothing here reaches the internet).

- `Olah`: olah (PyPI `olah`, a self-hosted Hub mirror) started with `offline = true` and `mirrors-path`
  over local git repos laid out as models/ORG/NAME on branch main: real downloads through the hub library.
- `PushHub`: the part of the Hub's HTTP API that huggingface_hub's client calls for a push (whoami, repo
  info, create and delete, validate-yaml, preupload, the LFS batch API with its upload and verify actions,
  commit), recording what arrives: commits with their message and files, and the bytes of every LFS
  upload. It answers a read of a gated repo as the Hub does (403, X-Error-Code GatedRepo). Each token has a
  role ("write" or "read", as whoami reports it) and the namespaces it may write to (None: any).
- `CutProxy`: a proxy in front of olah that cuts the body of one file halfway (and answers its resumes with
  503), to interrupt a download; switched to pass, it counts the bytes of each file it sends.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_MIN_BYTES = 64 * 1024  # files this large (or any *.safetensors/*.gguf) go through LFS, as the Hub's .gitattributes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url_host: str, port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            conn = http.client.HTTPConnection(url_host, port, timeout=2)
            conn.request("GET", path)
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing answered on {url_host}:{port} within {timeout} s")


def point_at(monkeypatch, endpoint: str) -> None:
    """The hub library in this process talking to ENDPOINT (it reads HF_ENDPOINT once, at import, into these)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


# ---------------------------------------------------------------- olah


def olah_command() -> list[str] | None:
    """How to start olah: `python -m olah.server` where this interpreter has it (the dev extra), else the
    `olah-cli` named by QUANTKIT_TEST_OLAH (olah installed in its own environment); None when neither."""
    import importlib.util

    if importlib.util.find_spec("olah") is not None:
        return [sys.executable, "-c", "from olah.server import cli; cli()"]
    named = os.environ.get("QUANTKIT_TEST_OLAH")
    return [named] if named and Path(named).is_file() else None


def git_repo(path: Path) -> str:
    """Commit everything in PATH on branch main (a fresh repo); the commit's sha."""
    run = lambda *args: subprocess.run(["git", *args], cwd=path, check=True, capture_output=True, text=True)  # noqa: E731
    if not (path / ".git").exists():
        run("init", "-q", "-b", "main")
    run("add", "-A")
    run("-c", "user.name=quantkit-tests", "-c", "user.email=tests@localhost", "commit", "-q", "-m", "model")
    return run("rev-parse", "HEAD").stdout.strip()


@dataclass
class Olah:
    """olah serving the git repos under MIRRORS (models/ORG/NAME) on a free port, offline."""

    mirrors: Path
    workdir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, command: list[str]) -> "Olah":
        config = self.workdir / "olah.toml"
        config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\nrepos-path = "{self.workdir / "repos"}"\n'
                          f'mirrors-path = ["{self.mirrors}"]\n[accessibility]\noffline = true\n')
        log = open(self.workdir / "olah.log", "w")
        self.process = subprocess.Popen([*command, "-c", str(config)], cwd=self.workdir, stdout=log,
                                        stderr=subprocess.STDOUT)
        wait_for("127.0.0.1", self.port, "/api/models/none/none/revision/main")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)


# ---------------------------------------------------------------- push


@dataclass
class Repo:
    private: bool
    files: dict[str, tuple[str, bytes | None]] = field(default_factory=dict)  # path -> (oid, content or None: LFS)
    commits: list[dict] = field(default_factory=list)

    @property
    def head(self) -> str:
        return self.commits[-1]["oid"] if self.commits else "0" * 40


@dataclass
class Recorded:
    """What the push server received."""

    repos: dict[str, Repo] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content
    uploads: list[tuple[str, int]] = field(default_factory=list)  # (oid, bytes) of every LFS upload, in order
    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    gated: set[str] = field(default_factory=set)


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class PushHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "PushHub"

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing
    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def send(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def refuse(self, status: int, code: str, message: str) -> None:
        self.send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def token(self) -> tuple[str, list[str] | None] | None:
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        return self.server.tokens.get(token)

    def role(self) -> str | None:
        found = self.token()
        return found[0] if found else None

    def can_write(self, repo_id: str) -> bool:
        found = self.token()
        if found and found[0] == "write" and (found[1] is None or repo_id.split("/")[0] in found[1]):
            return True
        self.refuse(403, "Forbidden", "You don't have the rights to write to this repository")
        return False

    # -- routes
    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/api/whoami-v2":
            role = self.role()
            if role is None:
                return self.refuse(401, "Unauthorized", "Invalid credentials in Authorization header")
            return self.send(200, {"type": "user", "name": "tester", "orgs": [],
                                   "auth": {"type": "access_token", "accessToken": {"displayName": "t", "role": role}}})
        if path.startswith("/api/models/"):
            return self.model_info(path.removeprefix("/api/models/").split("/revision/")[0])
        self.send(404, {"error": "not found"})

    def model_info(self, repo_id: str) -> None:
        recorded = self.server.recorded
        if repo_id in recorded.gated:
            return self.refuse(403, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to "
                                                 "it and be authenticated to access it.")
        repo = recorded.repos.get(repo_id)
        if repo is None or (repo.private and self.role() is None):
            return self.refuse(404, "RepoNotFound", "Repository not found")
        self.send(200, {"id": repo_id, "sha": repo.head, "private": repo.private,
                        "siblings": [{"rfilename": name} for name in sorted(repo.files)]})

    def do_POST(self) -> None:
        path, data = self.path.split("?")[0], self.body()
        if path == "/api/validate-yaml":
            return self.validate_yaml(json.loads(data))
        if path == "/api/repos/create":
            return self.create(json.loads(data))
        if path.endswith(".git/info/lfs/objects/batch"):
            return self.lfs_batch(path.removeprefix("/").removesuffix(".git/info/lfs/objects/batch"), json.loads(data))
        if path == "/lfs-verify":
            oid = json.loads(data)["oid"]
            return self.send(200 if oid in self.server.recorded.lfs else 404, {})
        if path.startswith("/api/models/") and "/preupload/" in path:
            return self.preupload(path.removeprefix("/api/models/").split("/preupload/")[0], json.loads(data))
        if path.startswith("/api/models/") and "/commit/" in path:
            return self.commit(path.removeprefix("/api/models/").split("/commit/")[0], data)
        self.send(404, {"error": "not found"})

    def do_DELETE(self) -> None:
        data = json.loads(self.body())
        repo_id = f"{data['organization']}/{data['name']}"
        if not self.can_write(repo_id):
            return
        self.server.recorded.repos.pop(repo_id, None)
        self.server.recorded.deleted.append(repo_id)
        self.send(200, {})

    def do_PUT(self) -> None:
        oid = self.path.removeprefix("/lfs-upload/")
        data = self.body()
        if hashlib.sha256(data).hexdigest() != oid:
            return self.send(400, {"error": "sha256 mismatch"})
        self.server.recorded.lfs[oid] = data
        self.server.recorded.uploads.append((oid, len(data)))
        self.send(200, {})

    def validate_yaml(self, payload: dict) -> None:
        import yaml

        text = payload["content"]
        try:
            front = yaml.safe_load(text.split("---", 2)[1]) if text.startswith("---") else {}
            if not isinstance(front, dict):
                raise ValueError("the metadata is not a mapping")
        except (yaml.YAMLError, ValueError, IndexError) as exc:
            return self.send(400, {"errors": [{"message": str(exc)}], "warnings": []})
        self.send(200, {"errors": [], "warnings": []})

    def create(self, payload: dict) -> None:
        repo_id = f"{payload['organization']}/{payload['name']}"
        if not self.can_write(repo_id):
            return
        if repo_id in self.server.recorded.repos:
            return self.refuse(409, "Conflict", "You already created this model repo")
        self.server.recorded.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        self.server.recorded.created.append(repo_id)
        self.send(200, {"url": f"{self.server.endpoint}/{repo_id}", "name": repo_id})

    def preupload(self, repo_id: str, payload: dict) -> None:
        repo = self.server.recorded.repos.get(repo_id)
        if repo is None:
            return self.refuse(404, "RepoNotFound", "Repository not found")
        if not self.can_write(repo_id):
            return
        files = []
        for f in payload["files"]:
            lfs = f["size"] >= LFS_MIN_BYTES or f["path"].endswith((".safetensors", ".gguf"))
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": repo.files.get(f["path"], (None,))[0]})
        self.send(200, {"files": files, "commitOid": repo.head})

    def lfs_batch(self, repo_id: str, payload: dict) -> None:
        if not self.can_write(repo_id):
            return
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.server.recorded.lfs:
                entry["actions"] = {"upload": {"href": f"{self.server.endpoint}/lfs-upload/{obj['oid']}", "header": {}},
                                    "verify": {"href": f"{self.server.endpoint}/lfs-verify", "header": {}}}
            objects.append(entry)
        self.send(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})

    def commit(self, repo_id: str, data: bytes) -> None:
        recorded = self.server.recorded
        repo = recorded.repos.get(repo_id)
        if repo is None:
            return self.refuse(404, "RepoNotFound", "Repository not found")
        if not self.can_write(repo_id) or self.server.refuse_commits:
            if self.server.refuse_commits:
                self.refuse(403, "Forbidden", "Commits to this repository are blocked")
            return
        header, changed = {}, {}
        for line in data.decode().splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                header = value
            elif item["key"] == "file":
                content = base64.b64decode(value["content"])
                changed[value["path"]] = (git_blob_oid(content), content)
            elif item["key"] == "lfsFile":
                if value["oid"] not in recorded.lfs:
                    return self.send(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                changed[value["path"]] = (value["oid"], None)
        oid = hashlib.sha1(f"{repo_id}{len(repo.commits)}{sorted(changed)}".encode()).hexdigest()
        repo.files.update(changed)
        repo.commits.append({"oid": oid, "summary": header.get("summary"), "description": header.get("description"),
                             "files": sorted(changed)})
        self.send(200, {"commitUrl": f"{self.server.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid,
                        "pullRequestUrl": None})


class PushHub(ThreadingHTTPServer):
    """The push server on a free port of 127.0.0.1, in a thread of the test process."""

    daemon_threads = True

    def __init__(self, tokens: dict[str, tuple[str, list[str] | None]]):
        super().__init__(("127.0.0.1", free_port()), PushHandler)
        self.tokens = tokens
        self.recorded = Recorded()
        self.refuse_commits = False  # answer every commit 403 (after the repo was created and the files uploaded)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def file(self, repo_id: str, path: str) -> bytes:
        """A file's bytes as the repo holds it now (an LFS file from the uploaded objects)."""
        oid, content = self.recorded.repos[repo_id].files[path]
        return content if content is not None else self.recorded.lfs[oid]

    def __enter__(self) -> "PushHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


# ---------------------------------------------------------------- an interrupted download


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "CutProxy"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.forward(head=True)

    def do_GET(self) -> None:
        self.forward(head=False)

    def forward(self, head: bool) -> None:
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "accept-encoding")}
        upstream.request("HEAD" if head else "GET", self.path, headers=headers)
        response = upstream.getresponse()
        data = b"" if head else response.read()
        name = self.path.split("?")[0].rsplit("/", 1)[-1]
        if name == self.server.cut_file and not head and self.server.cutting:
            return self.cut(response, data)
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", response.getheader("Content-Length", "0") if head else str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)
            if "/resolve/" in self.path:
                self.server.sent[name] = self.server.sent.get(name, 0) + len(data)

    def cut(self, response, data: bytes) -> None:
        """The first request: half the body, then the connection closes; the resumes: 503."""
        self.server.cuts += 1
        self.close_connection = True
        if self.server.cuts > 1:
            payload = b'{"error": "unavailable"}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        for key, value in response.getheaders():
            if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)


class CutProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream_port: int, cut_file: str):
        super().__init__(("127.0.0.1", free_port()), ProxyHandler)
        self.upstream_port = upstream_port
        self.cut_file = cut_file
        self.cutting = True
        self.cuts = 0
        self.sent: dict[str, int] = {}  # file name -> bytes of it sent whole (passing, not cut)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> "CutProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
