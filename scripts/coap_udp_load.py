#!/usr/bin/env python3
"""The operator's client of issue 30: aiocoap, `total` CoAP PUTs of `size` bytes to
coap://HOST/PATH, `window` at a time, from one UDP socket (so one sluice shard).

usage: coap_udp_load.py HOST PATH [--total 1500] [--window 64] [--size 900] [--sockets]

aiocoap keeps NSTART = 1 (RFC 7252 §4.7): one confirmable request outstanding per server
from one context, the rest wait in its backlog, so "64 at a time" from one context is one at
a time on the wire. --sockets gives each of the `window` workers its own context (socket),
so `window` requests are really outstanding.
"""
import argparse, asyncio, time
import aiocoap

async def main():
    a = argparse.ArgumentParser()
    a.add_argument("host"); a.add_argument("path")
    a.add_argument("--total", type=int, default=1500)
    a.add_argument("--window", type=int, default=64)
    a.add_argument("--size", type=int, default=900)
    a.add_argument("--sockets", action="store_true")
    o = a.parse_args()
    shared = await aiocoap.Context.create_client_context()
    codes = {}
    left = o.total
    t0 = time.time()
    async def worker():
        nonlocal left
        ctx = await aiocoap.Context.create_client_context() if o.sockets else shared
        while left > 0:
            left -= 1
            req = aiocoap.Message(code=aiocoap.PUT, uri="coap://%s/%s" % (o.host, o.path), payload=b"x" * o.size)
            try:
                res = await ctx.request(req).response
                codes[str(res.code)] = codes.get(str(res.code), 0) + 1
            except Exception as e:
                codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
    await asyncio.gather(*[worker() for _ in range(o.window)])
    el = time.time() - t0
    print("aiocoap (%s): %d PUTs of %d B in %.2f s (%.0f req/s): %s" % (
        "one context per worker" if o.sockets else "one context", o.total, o.size, el, o.total / el, codes))

asyncio.run(main())
