"""A slow server: a real HTTP proxy in front of a real ``mlflow server`` that holds every request
``delay_s`` before forwarding it, and counts them (path -> requests)."""
from __future__ import annotations

import collections
import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class SlowProxy:
    def __init__(self, target: str, delay_s: float) -> None:
        self.target, self.delay_s = urlparse(target), delay_s
        self.requests: collections.Counter = collections.Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests[self.path.split("?")[0]] += 1
                time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection(proxy.target.hostname, proxy.target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def batches(self) -> int:
        return sum(n for path, n in self.requests.items() if path.endswith("/runs/log-batch"))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
