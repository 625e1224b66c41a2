"""Real servers on the loopback for the remote tests and benchmarks/bench_remote.py: a plain HTTP server with
range requests and injected faults, and moto's S3 server (a real process), both on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import html
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FileServer(ThreadingHTTPServer):
    """Serves ``root`` over HTTP/1.1 with ``Range`` and directory listings; counts the body bytes it sends
    per file (``served``). ``faults[name]`` is a list of faults, one used per GET of that file:
    ``"drop"`` (headers and half the body, then the connection closes), ``"503"``, ``"stall"`` (no byte
    for ``stall_s`` seconds, then the connection closes), ``"changed"`` (other bytes of the same size)."""

    daemon_threads = True

    def __init__(self, root: Path, stall_s: float = 2.0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.stall_s = Path(root), stall_s
        self.faults: dict[str, list[str]] = {}
        self.served: Counter[str] = Counter()
        self.served_under: Counter[str] = Counter()  # body bytes by the request path's first folder
        self.requests: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:  # a client that hung up mid-body: not news here
        pass

    def take_fault(self, name: str) -> str | None:
        with self.lock:
            todo = self.faults.get(name)
            return todo.pop(0) if todo else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FileServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = self.server.root / rel
        if path.is_dir():
            return self._listing(path, rel, body)
        if not path.is_file():
            return self._status(404)
        name = path.name
        fault = self.server.take_fault(name) if body else None
        if fault == "503":
            return self._status(503)
        size = path.stat().st_size
        start, end = 0, size
        rng = self.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())):
            start = int(m.group(1)) if m.group(1) else max(0, size - int(m.group(2)))
            end = min(size, int(m.group(2)) + 1) if m.group(1) and m.group(2) else size
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:  # only the range asked for: the server's memory stays small
            f.seek(start)
            chunk = f.read(end - start)
        if fault == "changed":  # other bytes of the same size
            chunk = bytes(b ^ 0xFF for b in chunk[:64]) + chunk[64:]
        with self.server.lock:
            self.server.requests[name] += 1
        if fault == "stall":
            time.sleep(self.server.stall_s)
            self.close_connection = True
            return
        if fault == "drop":
            chunk = chunk[: len(chunk) // 2]
            self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.write(chunk)
            self.wfile.flush()
            with self.server.lock:
                self.server.served[name] += len(chunk)
                self.server.served_under[rel.split("/", 1)[0]] += len(chunk)
        if fault == "drop":
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def _status(self, code: int) -> None:
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _listing(self, path: Path, rel: str, body: bool) -> None:
        base = "/" + rel.strip("/") + "/" if rel.strip("/") else "/"
        links = "".join(f'<a href="{html.escape(base + p.name)}">{html.escape(p.name)}</a>\n'
                        for p in sorted(path.iterdir()))
        page = f"<html><body>\n{links}</body></html>\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self.wfile.write(page)


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

# moto's server in a process of its own, bound to a port the kernel picks as it binds (port 0), which it prints.
# (A port found free first and handed to `python -m moto.server -p PORT` could be taken meanwhile by another process:
# the suite runs on two workers, and Ray, torchrun and every outgoing connection take ports from the same range.)
_MOTO = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()  # returns once the socket is bound and listening
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # serve until the test closes our stdin (or ends us)
"""


@contextlib.contextmanager
def s3_server():
    """moto's S3 server as a process on 127.0.0.1; yields its endpoint, with the environment s3fs reads it
    from (``AWS_ENDPOINT_URL``, which botocore reads, and fake credentials) set in this process and its children."""
    proc = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    try:
        port = proc.stdout.readline().strip()  # "" if it died before it listened
        if not port.isdigit():
            raise RuntimeError(f"moto's S3 server did not start (exit code {proc.wait(10)})")
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.stdin.close()
        proc.terminate()
        proc.wait(10)
