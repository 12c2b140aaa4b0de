#!/usr/bin/env python3
"""A minimal edge function for `sluice-bench scenario functions` (standard library only).

Contract (sluice's local runtime): the listening socket is fd 3 when LISTEN_FDS is set
(systemd socket activation; sluice bound it), else the function binds 127.0.0.1:$PORT.
Every POST is answered 200 over HTTP/1.1 keep-alive with a small JSON body:
{"recv_ns": <CLOCK_REALTIME ns when the request was read>, "start_ns": <ns when this
script started>, "bytes": <request body length>}.
"""
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START_NS = time.time_ns()


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # http.server writes the head and the body in two writes: without TCP_NODELAY the body
    # waits for the peer's delayed ACK (~40 ms) on every keep-alive request.
    disable_nagle_algorithm = True

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        recv_ns = time.time_ns()
        out = b'{"recv_ns":%d,"start_ns":%d,"bytes":%d}' % (recv_ns, START_NS, len(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_PUT = do_POST

    def log_message(self, *args):
        pass


def main():
    if os.environ.get("LISTEN_FDS"):
        # The socket sluice bound and listens on: use it as it is (no bind, no listen).
        server = ThreadingHTTPServer(("127.0.0.1", 0), Echo, bind_and_activate=False)
        server.socket.close()
        server.socket = socket.socket(fileno=3)
        server.server_address = server.socket.getsockname()
    else:
        server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Echo)
    server.daemon_threads = True
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
