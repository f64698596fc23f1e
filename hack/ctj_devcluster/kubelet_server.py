"""The slice of the kubelet's HTTPS API that makes ``kubectl logs`` work.

``kubectl logs`` asks the API server, which connects to the node's kubelet endpoint
(status.daemonEndpoints on the node's InternalIP) with its kubelet client certificate.
Each agent serves ``/containerLogs/<ns>/<pod>/<container>`` (``follow``, ``tailLines``)
and ``/healthz`` on its node IP, on a port the kernel picks when it binds (port 0: nothing
can take it first) and the agent posts in its Node's daemonEndpoints, where the API server
looks, with a serving certificate from the cluster CA; it accepts only clients whose
certificate that CA signed. Logs hold every run of a container, appended.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

LogLocator = Callable[[str, str, str], "tuple[Path, Callable[[], bool]] | None"]
"""(namespace, pod, container) -> (log file, is the container still running?) or None."""


def _tail(data: bytes, lines: int) -> bytes:
    if lines < 0:
        return data
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:]) if lines else b""


class _Handler(BaseHTTPRequestHandler):
    server: KubeletServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        url = urlparse(self.path)
        parts = url.path.strip("/").split("/")
        if url.path in ("/healthz", "/readyz", "/livez"):
            self._reply(200, b"ok")
            return
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._reply(404, f"not served by the ctj node agent: {url.path}\n".encode())
            return
        found = self.server.locate(parts[1], parts[2], parts[3])
        if found is None:
            self._reply(
                404, f"container {parts[3]} of pod {parts[1]}/{parts[2]} not found\n".encode()
            )
            return
        path, running = found
        query = parse_qs(url.query)
        follow = query.get("follow", ["false"])[0] == "true"
        tail = int(query.get("tailLines", ["-1"])[0])
        data = path.read_bytes() if path.exists() else b""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if not follow:
            body = _tail(data, tail)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.end_headers()
        self.wfile.write(_tail(data, tail))
        self.wfile.flush()
        offset = len(data)
        try:
            while True:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                if chunk:
                    offset += len(chunk)
                    self.wfile.write(chunk)
                    self.wfile.flush()
                elif not running():
                    return
                else:
                    time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            return

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class KubeletServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        cert: Path,
        key: Path,
        client_ca: Path,
        locate: LogLocator,
    ) -> None:
        super().__init__(address, _Handler)
        self.locate = locate
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        ctx.load_verify_locations(str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.socket = ctx.wrap_socket(self.socket, server_side=True)

    @property
    def port(self) -> int:
        """The port it listens on (the one the kernel chose, if it was given 0)."""
        return int(self.server_address[1])

    def start(self) -> KubeletServer:
        threading.Thread(target=self.serve_forever, name="kubelet-api", daemon=True).start()
        return self
