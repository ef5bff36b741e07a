"""A local stand-in for the Hugging Face Hub's HTTP API, for tests: it serves repositories laid out
as {"datasets/ORG/NAME" or "ORG/NAME" (a model): {revision: {path: bytes}}} on 127.0.0.1, so
huggingface_hub and datasets run their own online code against it (HF_ENDPOINT pointed here).

The endpoints are those the clients call (huggingface_hub 1.x/2.x `hf_api.py`, `hf_file_system.py`
and `file_download.py`; datasets `load.py`), answered in the shapes those files parse:
- GET  /api/{datasets,models}/REPO/revision/REV           repo info: id, sha, siblings
- GET  /api/{datasets,models}/REPO/tree/REV[/PATH]        [?recursive=true] file and folder entries
- POST /api/{datasets,models}/REPO/paths-info/REV         form `paths=`: the entries of those paths
- HEAD, GET [Range] /datasets/REPO/resolve/REV/PATH       (models: /REPO/resolve/...) the bytes,
  with X-Repo-Commit, ETag, Content-Length, Accept-Ranges: bytes (206 and Content-Range on a Range)
REV is a name (URL-quoted: refs%2Fconvert%2Fparquet) or the commit sha the server gives it.
Anything else is 404 with X-Error-Code, as the Hub answers; `requests` records every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

API = re.compile(r"^/api/(datasets|models)/(.+?)/(revision|tree|paths-info)/([^/]+)(?:/(.*))?$")
RESOLVE = re.compile(r"^/(datasets/)?(.+?)/resolve/([^/]+)/(.+)$")


class HubServer:
    """`with HubServer(repos) as hub:` serves `repos` at hub.endpoint until the block ends."""

    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]):
        # a commit sha per (repo, revision), from its content, so it is stable across runs
        self.revisions: dict[tuple[str, str], tuple[str, dict[str, bytes]]] = {}
        for repo, revisions in repos.items():
            for rev, files in revisions.items():
                digest = hashlib.sha1(repr((repo, rev, sorted(files.items()))).encode())
                self.revisions[(repo, rev)] = self.revisions[(repo, digest.hexdigest())] = (
                    digest.hexdigest(),
                    files,
                )
        self.requests: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def lookup(self, kind: str, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | str:
        """(commit, files) of REPO at REV (a name or a commit), or the Hub's X-Error-Code."""
        key = f"datasets/{repo}" if kind == "datasets" else repo
        found = self.revisions.get((key, unquote(rev)))
        if found is None:
            known = any(name == key for name, _ in self.revisions)
            return "RevisionNotFound" if known else "RepoNotFound"
        return found


def _entries(files: dict[str, bytes], under: str, recursive: bool) -> list[dict]:
    """The tree entries below folder `under` ('' for the root), as /tree answers."""
    prefix = f"{under}/" if under else ""
    out: dict[str, dict] = {}
    for path, data in sorted(files.items()):
        if not path.startswith(prefix):
            continue
        parts = path[len(prefix) :].split("/")
        depth = len(parts) if recursive else 1
        for i in range(1, min(depth, len(parts) - 1) + 1):  # the folders on the way
            folder = prefix + "/".join(parts[:i])
            out.setdefault(folder, _folder(folder))
        if recursive or len(parts) == 1:
            out[path] = _file(path, data)
    return list(out.values())


def _file(path: str, data: bytes) -> dict:
    return {"type": "file", "path": path, "size": len(data), "oid": _oid(data)}


def _folder(path: str) -> dict:
    return {"type": "directory", "path": path, "oid": _oid(path.encode())}


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def _info(files: dict[str, bytes], path: str) -> dict | None:
    """The entry of one path (a file or a folder), as /paths-info answers for it."""
    if path in files:
        return _file(path, files[path])
    if any(p.startswith(path.rstrip("/") + "/") for p in files) or path in ("", "/"):
        return _folder(path.strip("/"))
    return None


def _handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the Hub serves
        # headers and body go out in two writes: without TCP_NODELAY, Nagle's algorithm holds
        # the second until the client's delayed ACK (~40 ms a response on Linux)
        disable_nagle_algorithm = True

        def log_message(self, *args) -> None:  # quiet: `requests` records them
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            self._serve(body=True, form=form)

        def _serve(self, body: bool, form: dict | None = None) -> None:
            server.requests.append(f"{self.command} {self.path}")
            url = urlsplit(self.path)
            api, resolve = API.match(url.path), RESOLVE.match(url.path)
            found = "EntryNotFound"
            if api:
                kind, repo, op, rev, rest = api.groups()
                found = server.lookup(kind, repo, rev)
                if not isinstance(found, str):
                    return self._api(op, repo, *found, unquote(rest or ""), url.query, form, body)
            elif resolve and not url.path.startswith("/api/"):
                kind = "datasets" if resolve.group(1) else "models"
                found = server.lookup(kind, resolve.group(2), resolve.group(3))
                path = unquote(resolve.group(4))
                if not isinstance(found, str) and path in found[1]:
                    return self._bytes(found[0], found[1][path], body)
                found = found if isinstance(found, str) else "EntryNotFound"
            self._error(found, body)

        def _api(self, op, repo, commit, files, rest, query, form, body) -> None:
            if op == "revision":
                siblings = [{"rfilename": p} for p in sorted(files)]
                info = {"id": repo, "sha": commit, "siblings": siblings, "private": False}
                return self._json(200, {**info, "gated": False, "disabled": False}, body)
            if op == "tree":
                if rest and _info(files, rest) is None:
                    return self._error("EntryNotFound", body)
                recursive = parse_qs(query).get("recursive", ["false"])[0] == "true"
                return self._json(200, _entries(files, rest.strip("/"), recursive), body)
            paths = (form or {}).get("paths", [])
            found = [e for e in (_info(files, p) for p in paths) if e is not None]
            self._json(200, found, body)

        def _bytes(self, commit: str, data: bytes, body: bool) -> None:
            start, end = 0, len(data) - 1
            ranged = re.match(r"bytes=(\d*)-(\d*)$", self.headers.get("Range") or "")
            if ranged and ranged.group(1):
                start = int(ranged.group(1))
                end = min(int(ranged.group(2)), end) if ranged.group(2) else end
            elif ranged and ranged.group(2):  # a suffix: the last N bytes
                start = max(0, len(data) - int(ranged.group(2)))
            self.send_response(206 if ranged else 200)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{_oid(data)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start + 1))
            self.end_headers()
            if body:
                self.wfile.write(data[start : end + 1])

        def _error(self, code: str, body: bool) -> None:
            self._json(404, {"error": code}, body, {"X-Error-Code": code})

        def _json(self, status: int, obj, body: bool, headers: dict | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
