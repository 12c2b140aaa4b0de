#!/usr/bin/env python3
"""CoAP-over-TCP (RFC 8323) request/response load on ONE connection, optionally MPTCP:
keeps `window` PUTs of `size` bytes outstanding until `total` are answered. Used by
scripts/mptcp-queueing-evidence.sh (ADR 0012) to see what the kernel's MPTCP scheduler does
with request/response traffic, with no sluice in the way.

usage: coap_tcp_load.py HOST PORT [--mptcp] [--total N] [--window W] [--size B] [--bind ADDR]
"""
import argparse, socket, struct, time

def frame(code, token, opts_payload):
    n = len(opts_payload)
    tkl = len(token)
    if n < 13:
        head = bytes([(n << 4) | tkl])
    elif n < 269:
        head = bytes([(13 << 4) | tkl, n - 13])
    elif n < 65805:
        head = bytes([(14 << 4) | tkl]) + struct.pack(">H", n - 269)
    else:
        head = bytes([(15 << 4) | tkl]) + struct.pack(">I", n - 65805)
    return head + bytes([code]) + token + opts_payload

def parse(buf):
    """-> (code, token, consumed) or None"""
    if not buf:
        return None
    ln, tkl = buf[0] >> 4, buf[0] & 15
    i = 1
    if ln == 13:
        if len(buf) < 2: return None
        ln = buf[1] + 13; i = 2
    elif ln == 14:
        if len(buf) < 3: return None
        ln = struct.unpack(">H", buf[1:3])[0] + 269; i = 3
    elif ln == 15:
        if len(buf) < 5: return None
        ln = struct.unpack(">I", buf[1:5])[0] + 65805; i = 5
    end = i + 1 + tkl + ln
    if len(buf) < end:
        return None
    return buf[i], bytes(buf[i + 1:i + 1 + tkl]), end

def main():
    a = argparse.ArgumentParser()
    a.add_argument("host"); a.add_argument("port", type=int)
    a.add_argument("--mptcp", action="store_true")
    a.add_argument("--no--mptcp", dest="nomptcp", action="store_true")
    a.add_argument("--total", type=int, default=1500)
    a.add_argument("--window", type=int, default=64)
    a.add_argument("--size", type=int, default=900)
    a.add_argument("--bind")
    a.add_argument("--path", default="example_data")
    o = a.parse_args()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262 if o.mptcp else 0)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if o.bind:
        s.bind((o.bind, 0))
    s.connect((o.host, o.port))
    s.settimeout(15)
    s.sendall(frame(0xE1, b"", b""))  # CSM
    path = o.path.encode()
    assert len(path) < 13
    body = bytes([0xB0 | len(path)]) + path + b"\xff" + b"x" * o.size
    buf = bytearray()
    sent = done = 0
    codes = {}
    t0 = time.time()
    lat = {}
    lats = []
    def send_one():
        nonlocal sent
        tok = struct.pack(">I", sent + 1)
        lat[tok] = time.time()
        s.sendall(frame(0x03, tok, body))
        sent += 1
    while sent < min(o.window, o.total):
        send_one()
    while done < o.total:
        try:
            d = s.recv(65536)
        except socket.timeout:
            raise SystemExit("stalled: no answer for 15 s after %d answers (%d sent)" % (done, sent))
        if not d:
            raise SystemExit("closed by the server after %d answers" % done)
        buf += d
        while True:
            p = parse(buf)
            if not p:
                break
            code, tok, n = p
            del buf[:n]
            if code >> 5 == 7:  # signal (CSM, Pong)
                continue
            codes[code] = codes.get(code, 0) + 1
            if tok in lat:
                lats.append(time.time() - lat.pop(tok))
            done += 1
            if sent < o.total:
                send_one()
    el = time.time() - t0
    lats.sort()
    print("answered %d in %.2f s: %.0f req/s; codes %s; p50 %.0f ms p99 %.0f ms" % (
        done, el, done / el, {"%d.%02d" % (c >> 5, c & 31): v for c, v in codes.items()},
        lats[len(lats) // 2] * 1e3, lats[int(len(lats) * 0.99)] * 1e3))
    s.close()

if __name__ == "__main__":
    main()
