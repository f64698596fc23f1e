"""An embedded S3 server on loopback (moto's server mode) for the demo and the tests.

Production uses real S3 or MinIO; this exists so the README's first command and
the test suite get a real S3 endpoint with nothing installed by hand.

No port race: ``LocalS3.start()`` binds a listening socket on port 0 itself and hands it
to the server process (``python -m ctj_devcluster.local_s3 --fd N``, moto's app on
werkzeug, as ``moto.server`` runs it), so the port is known, and held, before the server
even starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .ports import free_port

__all__ = ["TEST_CREDENTIALS", "LocalS3", "free_port", "wait_for_port"]

TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}
_HACK_DIR = Path(__file__).resolve().parent.parent


def wait_for_port(port: int, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    """Waits until something accepts connections on 127.0.0.1:``port`` (raises if
    ``proc`` exits first)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {deadline_s}s")


def _wait_serving(endpoint: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    """Until the server answers HTTP (the socket accepts from the start: it is ours)."""
    deadline = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # an answer, if not a 200
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"moto at {endpoint} not answering after {deadline_s}s") from exc
            time.sleep(0.05)


@dataclasses.dataclass
class LocalS3:
    endpoint: str
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, *, extra_env: dict[str, str] | None = None) -> LocalS3:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            port = int(listener.getsockname()[1])
            pythonpath = os.pathsep.join(
                p for p in (str(_HACK_DIR), os.environ.get("PYTHONPATH")) if p
            )
            env = {**os.environ, "MOTO_PORT": str(port), **(extra_env or {})}
            env["PYTHONPATH"] = pythonpath
            fd = listener.fileno()
            proc = subprocess.Popen(
                [sys.executable, "-m", "ctj_devcluster.local_s3", f"--fd={fd}"],
                env=env,
                pass_fds=(fd,),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            listener.close()  # the server holds its own copy
        endpoint = f"http://127.0.0.1:{port}"
        try:
            _wait_serving(endpoint, proc, 60)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return cls(endpoint, proc)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, **TEST_CREDENTIALS}

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve(fd: int) -> None:
    """moto's S3 (every service, as ``moto.server``) on the listening socket ``fd``."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    app.debug = True  # type: ignore[attr-defined]  # as moto.server: tracebacks in 500s
    sock = socket.socket(fileno=fd)  # learn the address, then hand the fd to werkzeug
    host, port = sock.getsockname()[:2]
    sock.detach()
    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler, fd=fd)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="moto's server on an inherited socket")
    parser.add_argument("--fd", type=int, required=True, help="a listening TCP socket")
    _serve(parser.parse_args(argv).fd)


if __name__ == "__main__":
    main()
