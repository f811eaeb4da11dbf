"""A local fake of the Hub's HTTP API (127.0.0.1, in a thread): what ``HfApi`` calls for an upload, answered
and recorded, so that no test ever makes a real network call."""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class FakeHub:
    """Answers the endpoints ``HfApi.whoami`` / ``create_repo`` / ``create_branch`` / ``upload_folder`` use
    for small files: the token's identity, repo create, yaml validation, preupload (always "regular", so no
    LFS or Xet transfer) and the ndjson commit. Records what it received."""

    def __init__(self, token_roles: dict[str, str] | None = None):
        self.repos, self.branches, self.commits, self.auth_headers, self.paths = set(), set(), [], [], []
        # whoami-v2 answers these tokens with their role ("write", "read"), any other with 401; None: any.
        self.token_roles = token_roles
        hub_state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean (and header-free)
                pass

            def _reply(self, status, payload):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # http.server's naming
                hub_state.auth_headers.append(self.headers.get("Authorization"))
                path = unquote(urlparse(self.path).path)
                hub_state.paths.append(path)
                if path == "/api/whoami-v2":
                    token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                    roles = hub_state.token_roles
                    role = "write" if roles is None else roles.get(token)
                    if role is None:
                        return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                    return self._reply(
                        200, {"type": "user", "name": "fake-user", "auth": {"accessToken": {"role": role}}}
                    )
                return self._reply(404, {"error": f"fake hub does not serve {path}"})

            def do_POST(self):  # http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                hub_state.auth_headers.append(self.headers.get("Authorization"))
                path = unquote(urlparse(self.path).path)
                hub_state.paths.append(path)
                endpoint = f"http://127.0.0.1:{self.server.server_port}"
                parts = path.strip("/").split("/")
                if path == "/api/repos/create":
                    body = json.loads(raw)
                    repo_id = f"{body['organization'] or 'fake-user'}/{body['name']}"
                    if repo_id in hub_state.repos:
                        # Like the Hub: the 409 still names the repo's url, which `exist_ok` returns.
                        return self._reply(
                            409,
                            {"error": "You already created this model repo", "url": f"{endpoint}/{repo_id}"},
                        )
                    hub_state.repos.add(repo_id)
                    return self._reply(200, {"url": f"{endpoint}/{repo_id}", "name": repo_id})
                if path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                if len(parts) >= 5 and parts[:2] == ["api", "models"]:
                    repo_id, action = "/".join(parts[2:4]), parts[4]
                    if repo_id not in hub_state.repos:
                        return self._reply(404, {"error": "Repository not found"})
                    if action == "preupload":
                        files = json.loads(raw)["files"]
                        return self._reply(
                            200,
                            {
                                "files": [
                                    {
                                        "path": f["path"],
                                        "uploadMode": "regular",
                                        "shouldIgnore": False,
                                        "oid": None,
                                    }
                                    for f in files
                                ]
                            },
                        )
                    if action == "branch":
                        hub_state.branches.add((repo_id, "/".join(parts[5:])))
                        return self._reply(200, {})
                    if action == "commit":
                        revision = "/".join(parts[5:])
                        lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
                        files = {
                            item["value"]["path"]: base64.b64decode(item["value"]["content"])
                            for item in lines
                            if item["key"] == "file"
                        }
                        other = [item["key"] for item in lines if item["key"] not in ("header", "file")]
                        hub_state.commits.append(
                            {
                                "repo_id": repo_id,
                                "revision": revision,
                                "header": lines[0]["value"],
                                "files": files,
                                "other": other,
                            }
                        )
                        oid = f"{len(hub_state.commits):040x}"
                        return self._reply(
                            200, {"commitUrl": f"{endpoint}/{repo_id}/commit/{oid}", "commitOid": oid}
                        )
                return self._reply(404, {"error": f"fake hub does not serve {path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
