"""An edge function for the sluice function tests: CloudEvents 1.0 over HTTP/1.1 keep-alive.

Where it listens:
  LISTEN_FDS set  the listening socket sluice hands over as fd 3 (socket = "inherit"); the
                  start record says so ("fd3": true) and checks LISTEN_PID is this process
  else            binds 127.0.0.1:$PORT itself (PORT=0 or unset: any free port)
FN_BIND=port makes it bind $PORT even when LISTEN_FDS is set: a function written to
Knative's runtime contract only (as `python -m http.server $PORT`, Flask or Express are).
Once it accepts, it prints "listening PORT" on stdout (flushed).

Each POST is parsed with the CloudEvents SDK (cloudevents 2.2.0,
`cloudevents.core.bindings.http.from_http`, which raises on missing or invalid attributes):
an event that does not parse is answered 400 with the SDK's error. A parsed event is handled
by its mode: FN_MODE (default "ok"), overridden per event by a topic level named "ok",
"quiet", "fail", "reject", "hang" or "exit":
  ok     200, JSON body: the parsed attributes (id, source, type, specversion, subject, time,
         datacontenttype), data (parsed JSON or text; `data_hex` when binary), pid and port
         (the client's port: which connection carried it); after FN_SLEEP_MS milliseconds
  quiet  204, no body (nothing to reply)
  fail   500
  reject 422 (the function refuses the event itself)
  hang   no answer (sleeps FN_HANG_S seconds, default 3600, holding the connection)
  exit   the process exits (status 3) without answering
FN_CRASH_ON_START=1 makes the process exit (status 2) right after its start record.

FN_LOG names a file that gets one JSON object per line: {"start": PID, "fd3": BOOL, "t": UNIX
TIME} when the process starts, then per request {"pid", "port", "id", "subject", "source",
"type", "datacontenttype", "status"} (status null for hang and exit, written before them).
Each line is one write(2) on an O_APPEND descriptor, so lines of concurrent requests and of
several instances never interleave.
"""

import json
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cloudevents.core.bindings.http import HTTPMessage, from_http
from cloudevents.core.formats.json import JSONFormat

MODES = ("ok", "quiet", "fail", "reject", "hang", "exit")
LOG_FD = None
if os.environ.get("FN_LOG"):
    LOG_FD = os.open(os.environ["FN_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def record(obj):
    if LOG_FD is not None:
        os.write(LOG_FD, (json.dumps(obj) + "\n").encode())


def mode_of(subject):
    for level in (subject or "").split("/"):
        if level in MODES:
            return level
    return os.environ.get("FN_MODE", "ok")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless the client says otherwise

    def log_message(self, fmt, *args):  # quiet: the tests read FN_LOG
        pass

    def answer(self, status, body, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length) if length else b""
        port = self.client_address[1]
        headers = {k: v for k, v in self.headers.items()}
        try:
            event = from_http(HTTPMessage(headers=headers, body=body), JSONFormat())
        except Exception as e:  # the SDK's validation errors: the event is not valid
            error = f"{e!r} {getattr(e, 'errors', '')}"
            record({"pid": os.getpid(), "port": port, "id": None, "subject": None,
                    "status": 400, "error": error})
            self.answer(400, error.encode(), "text/plain")
            return
        subject = event.get_subject()
        mode = mode_of(subject)
        entry = {"pid": os.getpid(), "port": port, "id": event.get_id(), "subject": subject,
                 "source": event.get_source(), "type": event.get_type(),
                 "datacontenttype": event.get_datacontenttype()}
        if mode == "exit":
            record(dict(entry, status=None))
            os._exit(3)
        if mode == "hang":
            record(dict(entry, status=None))
            time.sleep(float(os.environ.get("FN_HANG_S", "3600")))
            self.close_connection = True
            return
        if mode == "quiet":
            record(dict(entry, status=204))
            self.send_response(204)  # no Content-Length: a 204 has no body (RFC 9110 8.6)
            self.end_headers()
            return
        if mode == "fail":
            record(dict(entry, status=500))
            self.answer(500, b"failing on purpose", "text/plain")
            return
        if mode == "reject":
            record(dict(entry, status=422))
            self.answer(422, b"refusing on purpose", "text/plain")
            return
        sleep_ms = float(os.environ.get("FN_SLEEP_MS", "0"))
        if sleep_ms > 0:
            time.sleep(sleep_ms / 1000.0)
        data = event.get_data()
        out = {
            "id": event.get_id(),
            "source": event.get_source(),
            "type": event.get_type(),
            "specversion": event.get_specversion(),
            "subject": subject,
            "time": event.get_time().isoformat() if event.get_time() else None,
            "datacontenttype": event.get_datacontenttype(),
            "pid": os.getpid(),
            "port": port,
        }
        if isinstance(data, (bytes, bytearray)):
            out["data_hex"] = bytes(data).hex()
        else:
            out["data"] = data
        record(dict(entry, status=200))
        self.answer(200, json.dumps(out).encode())


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


def listening_socket():
    if os.environ.get("LISTEN_FDS") and os.environ.get("FN_BIND") != "port":
        pid = os.environ.get("LISTEN_PID")
        if pid is not None and pid != str(os.getpid()):
            sys.exit(f"LISTEN_PID {pid} is not this process ({os.getpid()})")
        return socket.socket(fileno=3), True
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(os.environ.get("PORT") or "0")))
    s.listen(128)
    return s, False


def main():
    sock, fd3 = listening_socket()
    record({"start": os.getpid(), "fd3": fd3, "t": time.time()})
    if os.environ.get("FN_CRASH_ON_START") == "1":
        sys.exit(2)
    server = Server(("127.0.0.1", 0), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_address = sock.getsockname()
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
