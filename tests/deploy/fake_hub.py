"""A Hugging Face hub on localhost: the few endpoints ``huggingface_hub``'s ``snapshot_download``
and ``hf_hub_download`` use (huggingface_hub 1.x/2.x), answered the way huggingface.co does.

    GET  /api/models/{repo}[/revision/{rev}]      model info: sha, siblings
    GET  /api/models/{repo}/tree/{rev}[/{path}]   the file listing (recursive)
    HEAD /{repo}/resolve/{rev}/{file}             X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}             the bytes; ``Range: bytes=N-`` -> 206

Errors carry hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo) so that the client raises its own exception classes. A gated repo wants
``Authorization: Bearer <token>``. ``cut_once`` makes the first GET of a file stop after some
bytes: ``"close"`` drops the connection, ``"stall"`` waits (for a client to be killed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import re
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclasses.dataclass
class Repo:
    trees: dict[str, dict[str, Path]]  # commit sha -> path in repo -> file on disk
    refs: dict[str, str]  # branch or tag -> commit sha
    token: str | None = None  # gated: this bearer token is needed

    def commit(self, rev: str) -> str | None:
        return rev if rev in self.trees else self.refs.get(rev)


@dataclasses.dataclass
class Cut:
    at: int  # bytes sent before the cut
    mode: str  # "close" or "stall"
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # cut happened
    release: threading.Event = dataclasses.field(default_factory=threading.Event)


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


class FakeHub:
    """Serves ``repos`` on 127.0.0.1 until :meth:`close`. ``requests`` logs (method, path,
    Range header, Authorization header) of every request."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None, str | None]] = []
        self.cuts: dict[str, Cut] = {}  # file path in repo -> its cut
        self._etags: dict[Path, str] = {}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:  # noqa: N802
                hub._handle(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                hub._handle(self, head=False)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def add(
        self, repo_id: str, revisions: dict[str, Path | dict[str, Path]], token: str | None = None
    ) -> None:
        """``revisions``: branch or tag -> a folder, or {path in repo: file}, at that ref."""
        trees, refs = {}, {}
        for ref, files in revisions.items():
            commit = hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
            trees[commit] = files if isinstance(files, dict) else _files_of(Path(files))
            refs[ref] = commit
        self.repos[repo_id] = Repo(trees=trees, refs=refs, token=token)

    def close(self) -> None:
        for cut in self.cuts.values():
            cut.release.set()
        self._server.shutdown()
        self._server.server_close()

    def downloads(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of files named ``name``."""
        return [r for m, p, r, _ in self.requests if m == "GET" and p.endswith("/" + name)]

    # ---- requests ----------------------------------------------------------------------------
    def _etag(self, path: Path) -> str:
        if path not in self._etags:
            self._etags[path] = _sha1(path)
        return self._etags[path]

    def _handle(self, h: http.server.BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(
            (
                "HEAD" if head else "GET",
                path,
                h.headers.get("Range"),
                h.headers.get("Authorization"),
            )
        )
        m = re.fullmatch(r"/api/models/(.+?)(?:/revision/([^/]+))?", path)
        tree = re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(/.*)?", path)
        resolve = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
        if tree:
            repo_id, rev, _ = tree.groups()
        elif m:
            repo_id, rev = m.group(1), m.group(2) or "main"
        elif resolve:
            repo_id, rev, _ = resolve.groups()
        else:
            return self._error(h, 404, None, "not an endpoint of this fake hub")
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 401, "RepoNotFound", "Repository not found")
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            status = 401 if h.headers.get("Authorization") is None else 403
            return self._error(h, status, "GatedRepo", "Access to model is restricted")
        commit = repo.commit(rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if tree:
            listing = [
                {"type": "file", "oid": self._etag(f), "size": f.stat().st_size, "path": name}
                for name, f in sorted(repo.trees[commit].items())
            ]
            return self._json(h, listing, head)
        if m:
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": False,
                "gated": repo.token is not None,
                "siblings": [{"rfilename": name} for name in sorted(repo.trees[commit])],
            }
            return self._json(h, info, head)
        name = resolve.group(3)
        if name not in repo.trees[commit]:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist", commit)
        self._send_file(h, repo.trees[commit][name], name, commit, head)

    def _send_file(self, h, path: Path, name: str, commit: str, head: bool) -> None:  # noqa: ANN001
        data = path.read_bytes()
        start = 0
        rng = h.headers.get("Range")
        if rng and not head:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{self._etag(path)}"')
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        if head:
            return
        cut = self.cuts.get(name)
        if cut is not None and not cut.done.is_set():
            h.wfile.write(data[start : cut.at])
            h.wfile.flush()
            cut.done.set()
            if cut.mode == "stall":
                cut.release.wait(120)
            h.close_connection = True
            return
        h.wfile.write(data[start:])

    def _json(self, h, body: object, head: bool) -> None:  # noqa: ANN001
        data = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not head:
            h.wfile.write(data)

    def _error(self, h, status: int, code: str | None, message: str, commit: str | None = None):  # noqa: ANN001
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


def _files_of(folder: Path) -> dict[str, Path]:
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
