"""A stand-in for the Hugging Face Hub on 127.0.0.1: the subset of its HTTP API that
huggingface_hub's create_repo, create_branch, list_repo_files and create_commit (regular, base64
files) use. The one stand-in the tests allow, at the network seam only (HF_ENDPOINT points here).

Tokens: WRITE may do anything, READ is refused writes (403), anything else is 401.
Everything it received is kept: repos, their visibility, branches and files, and every request line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

WRITE, READ = "hf_standin_write_token_7f3a9c", "hf_standin_read_token_2b8e1d"


class Hub:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.commits: list[dict] = []  # {"repo", "branch", "summary"}
        self.requests: list[str] = []  # "METHOD path" of every request
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Hub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _auth(self, write: bool) -> bool:
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                if token not in (WRITE, READ):
                    self._send(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                if write and token != WRITE:
                    self._send(403, {"error": "You don't have the rights to write to this repo"})
                    return False
                return True

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))

            def do_GET(self):
                hub.requests.append(f"GET {self.path}")
                path = unquote(urlparse(self.path).path)
                if not self._auth(write=False):
                    return
                parts = path.split("/")  # /api/models/{o}/{n}/tree/{rev}
                if path.startswith("/api/models/") and len(parts) >= 7 and parts[5] == "tree":
                    repo, rev = f"{parts[3]}/{parts[4]}", parts[6]
                    if repo not in hub.repos:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    files = hub.repos[repo]["branches"].get(rev)
                    if files is None:
                        return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    return self._send(200, [{"type": "file", "path": p, "size": len(b),
                                             "oid": hashlib.sha1(b).hexdigest()} for p, b in sorted(files.items())])
                self._send(404, {"error": f"not in the stand-in: GET {path}"})

            def do_POST(self):
                hub.requests.append(f"POST {self.path}")
                path = unquote(urlparse(self.path).path)
                body = self._body()
                if path == "/api/validate-yaml":
                    return self._send(200, {"errors": [], "warnings": []})
                if not self._auth(write=True):
                    return
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req['organization']}/{req['name']}"
                    if repo in hub.repos:
                        return self._send(409, {"error": "You already created this model repo",
                                                "url": f"{hub.url}/{repo}"})
                    hub.repos[repo] = {"private": req.get("visibility") == "private" or bool(req.get("private")),
                                       "branches": {"main": {".gitattributes": b"*.safetensors filter=lfs\n"}}}
                    return self._send(200, {"url": f"{hub.url}/{repo}", "name": repo})
                parts = path.split("/")  # /api/models/{o}/{n}/{verb}/{rev}
                if not (path.startswith("/api/models/") and len(parts) >= 7):
                    return self._send(404, {"error": f"not in the stand-in: POST {path}"})
                repo, verb, rev = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:])
                if repo not in hub.repos:
                    return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                branches = hub.repos[repo]["branches"]
                if verb == "branch":
                    if rev in branches:
                        return self._send(409, {"error": "Reference already exists"})
                    branches[rev] = dict(branches["main"])
                    return self._send(200, {})
                if verb == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False, "oid": None} for f in files]})
                if verb == "commit":
                    if rev not in branches:
                        return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    files, summary = dict(branches[rev]), ""
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "header":
                            summary = item["value"]["summary"]
                        elif item["key"] == "file":
                            files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                        elif item["key"] == "deletedFile":
                            files.pop(item["value"]["path"], None)
                        else:
                            return self._send(400, {"error": f"the stand-in takes regular files only: {item['key']}"})
                    branches[rev] = files
                    oid = hashlib.sha1(repr(sorted(files)).encode() + summary.encode()).hexdigest()
                    hub.commits.append({"repo": repo, "branch": rev, "summary": summary})
                    return self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                                            "success": True})
                self._send(404, {"error": f"not in the stand-in: POST {path}"})

        return Handler
