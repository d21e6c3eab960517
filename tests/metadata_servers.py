"""Fake cloud metadata services on 127.0.0.1 (a port chosen by the OS), speaking each cloud's protocol.

Paths are prefixed with ``/node<N>`` so simulated nodes sharing this machine each have their own service
(orch's endpoints accept ``{node}``). ``arm(node)`` makes that node's service announce a preemption once.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeMetadata:
    """``kind`` is aws (IMDSv2: token PUT, then spot/instance-action), gcp (instance/preempted with
    wait_for_change) or azure (scheduledevents)."""

    def __init__(self, kind: str):
        self.kind, self.armed, self.served = kind, set(), []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_PUT(self):
                if fake.kind == "aws" and self.path.endswith("/latest/api/token") and \
                        self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._reply(200, "token-" + self.path.split("/")[1])
                self._reply(403, "")

            def do_GET(self):
                node = self.path.split("/")[1]
                reply = getattr(fake, f"_{fake.kind}")(node, self.path, self.headers)
                self._reply(*reply)

            def _reply(self, status: int, body: str):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/node{{node}}"

    def arm(self, node: int) -> None:
        self.armed.add(f"node{node}")

    def _take(self, node: str) -> bool:
        if node in self.armed:
            self.armed.discard(node)  # announce once: a replacement node is a new machine
            self.served.append(node)
            return True
        return False

    def _aws(self, node, path, headers):
        if headers.get("X-aws-ec2-metadata-token") != f"token-{node}":
            return 401, ""
        if path.endswith("/latest/meta-data/spot/instance-action") and self._take(node):
            return 200, json.dumps({"action": "terminate", "time": "2026-11-29T12:00:00Z"})
        return 404, ""

    def _gcp(self, node, path, headers):
        if headers.get("Metadata-Flavor") != "Google":
            return 403, ""
        if "/computeMetadata/v1/instance/preempted" in path:
            return 200, "TRUE" if self._take(node) else "FALSE"
        return 404, ""

    def _azure(self, node, path, headers):
        if headers.get("Metadata") != "true":
            return 400, ""
        events = [{"EventId": "e1", "EventType": "Preempt", "NotBefore": "Sun, 29 Nov 2026 12:00:00 GMT"}] \
            if self._take(node) else []
        return 200, json.dumps({"DocumentIncarnation": 1, "Events": events})

    def __enter__(self) -> "FakeMetadata":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
