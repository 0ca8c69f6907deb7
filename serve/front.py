"""The HTTP front of ``aotpack serve``: KServe v2 requests are checked before tritonserver reads them.

tritonserver's HTTP frontend allocates what a JSON body's ``shape`` declares before it reads the
data (a 200-byte body declaring ``[1, 2**40, 16]`` aborts the server) and answers a malformed body
with HTTP 500. So ``aotpack serve`` listens on the public HTTP port itself and relays to a
tritonserver bound to a loopback port: an inference request for the model is first checked by
``aot.serve.requests.RequestCheck`` (JSON, inputs, declared shapes against the guards, data against
the shapes) and refused with HTTP 400 and the reason when it fails. Everything else passes through
unchanged, except that readiness answers 503 once the model's backend process has died.

A second front serves the public metrics port: tritonserver's Prometheus text, with the requests
refused here added to ``nv_inference_request_failure{reason="REJECTED"}`` of the model (they never
reached tritonserver, which would not count them), and so are those the model answered 400 over
HTTP (outside the guards: tritonserver 2.51 counts a Python-backend error response as a success,
so they are moved out of ``nv_inference_request_success``). A 400 over gRPC stays a success there.

Both are threaded stdlib HTTP/1.1 servers with keep-alive on both sides: one upstream connection
per client connection.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from aot.errors import GuardError
from aot.serve.requests import RequestCheck, parse_kserve

MAX_BODY = 64 * 1024 * 1024  # tritonserver's own default for --http-max-input-size
IDLE_TIMEOUT_S = 60.0  # a client connection silent this long is closed
SHUTDOWN_POLL_S = 0.05  # how often the front looks for its shutdown (SIGTERM returns this fast)
UPSTREAM_TIMEOUT_S = 600.0  # one inference may take this long (a large bundle on the CPU)
HEADER_LENGTH = "Inference-Header-Content-Length"
HOP_BY_HOP = frozenset(
    "connection keep-alive proxy-authenticate proxy-authorization te trailers transfer-encoding upgrade "
    "host content-length".split()
)
_INFER = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/[^/]+)?/infer$")
_READY = re.compile(r"^/v2/health/ready$|^/v2/models/[^/]+(?:/versions/[^/]+)?/ready$")


class Front(ThreadingHTTPServer):
    """Serves a public port; ``upstream`` is tritonserver's loopback port for the same endpoint.
    ``check`` is None for the metrics front."""

    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: str,
        port: int,
        upstream: int,
        model: str,
        check: RequestCheck | None,
        alive: Callable[[], bool],
        refused: Refused,
    ):
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.upstream, self.model, self.check, self.alive, self.refused = (
            upstream,
            model,
            check,
            alive,
            refused,
        )
        super().__init__((address, port), _Handler)

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(
            target=self.serve_forever, args=(SHUTDOWN_POLL_S,), name="aotpack-front", daemon=True
        )
        thread.start()
        return thread


class Refused:
    """Requests refused for the client's fault (thread-safe): ``here`` by the front, before
    tritonserver saw them; ``by_model`` answered 400 by the model (outside the guards), which
    tritonserver 2.51 counts as successes."""

    def __init__(self) -> None:
        self.here = self.by_model = 0
        self._lock = threading.Lock()

    def add(self, by_model: bool = False) -> None:
        with self._lock:
            if by_model:
                self.by_model += 1
            else:
                self.here += 1


def _metric(name: str, model: str, extra: str = "") -> re.Pattern:
    labels = rf'(?=[^}}]*model="{re.escape(model)}")' + (rf"(?=[^}}]*{extra})" if extra else "")
    return re.compile(rf"^({name}\{{{labels}[^}}]*\}} )(\d+)$", re.M)


def count_refused(text: str, model: str, refused: Refused) -> str:
    """tritonserver's metrics text with the client errors of ``refused`` counted as failures of
    the model (reason REJECTED), and those the model answered taken out of its successes."""
    text = _metric("nv_inference_request_failure", model, 'reason="REJECTED"').sub(
        lambda m: f"{m[1]}{int(m[2]) + refused.here + refused.by_model}", text
    )
    return _metric("nv_inference_request_success", model).sub(
        lambda m: f"{m[1]}{max(0, int(m[2]) - refused.by_model)}", text
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    server: Front

    def log_message(self, format: str, *args) -> None:  # tritonserver logs requests, if asked
        pass

    def setup(self) -> None:
        super().setup()
        self.upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        super().finish()
        if self.upstream is not None:
            self.upstream.close()

    def _answer(self, status: int, body: bytes, headers: list[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        for key, value in headers:
            if key.lower() not in HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._answer(status, json.dumps({"error": message}).encode(), [("Content-Type", "application/json")])

    def _body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            self._error(411, "send the request with a Content-Length, not chunked")
            return None
        text = self.headers.get("Content-Length", "0")
        if not text.isdigit() or int(text) > MAX_BODY:
            self.close_connection = True
            self._error(
                413 if text.isdigit() else 400, f"Content-Length {text[:24]!r}: at most {MAX_BODY} bytes"
            )
            return None
        return self.rfile.read(int(text))

    def _relay(self, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        for attempt in (0, 1):  # a kept-alive upstream connection may have closed meanwhile
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(
                    "127.0.0.1", self.server.upstream, timeout=UPSTREAM_TIMEOUT_S
                )
            try:
                self.upstream.request(self.command, self.path, body=body, headers=headers)
                response = self.upstream.getresponse()
                data = response.read()
                break
            except (OSError, http.client.HTTPException):
                self.upstream.close()
                self.upstream = None
                if attempt:
                    return self._error(503, "the model server is not reachable")
        path = self.path.split("?", 1)[0]
        if self.server.check is None and path == "/metrics" and response.status == 200:
            data = count_refused(
                data.decode("utf-8", "replace"), self.server.model, self.server.refused
            ).encode()
        if self.server.check is not None and response.status == 400 and self._ours():
            self.server.refused.add(by_model=True)
        self._answer(response.status, data, response.getheaders())

    def _ours(self) -> bool:
        found = _INFER.match(self.path.split("?", 1)[0])
        return self.command == "POST" and found is not None and found["name"] == self.server.model

    def _handle(self) -> None:
        body = self._body()
        if body is None:
            return
        path = self.path.split("?", 1)[0]
        if _READY.match(path) and not self.server.alive():
            return self._answer(503, b"")
        if self.server.check is None or not self._ours():
            return self._relay(body)
        try:
            length = self.headers.get(HEADER_LENGTH)
            if length is not None and not length.isdigit():
                raise GuardError(f"{HEADER_LENGTH} {length[:24]!r} is not a byte count")
            parsed, binary = parse_kserve(body, None if length is None else int(length))
            self.server.check.kserve(parsed, binary)
        except GuardError as e:
            self.server.refused.add()
            return self._error(400, str(e))
        self._relay(body)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _handle
