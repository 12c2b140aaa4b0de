"""A CoAP device built on aiocoap, driven by the sluice CoAP peer tests.

  publish URI HEX con|non   one POST; prints {"code": "2.04", "payload": HEX} (NON: the
                            response if one comes within 3 s, else {"code": null})
  stream URI PREFIX COUNT   COUNT CON POSTs one after another (each after the previous
                            response), payload PREFIX-i; prints {"i": i, "code": ...} per POST
  observe URI N             GET with Observe; prints {"registered": CODE}, then one
                            {"payload": HEX} per notification; exits after N notifications

One JSON object per line, flushed at once. Exit status 0 unless aiocoap raised.
"""

import asyncio
import json
import sys

import aiocoap
from aiocoap import GET, POST, Context, Message


def emit(obj):
    print(json.dumps(obj), flush=True)


async def publish(ctx, uri, payload_hex, kind):
    tuning = aiocoap.Reliable if kind == "con" else aiocoap.Unreliable
    msg = Message(code=POST, uri=uri, payload=bytes.fromhex(payload_hex), transport_tuning=tuning)
    req = ctx.request(msg)
    if kind == "con":
        resp = await req.response
    else:
        try:
            resp = await asyncio.wait_for(req.response, 3)
        except asyncio.TimeoutError:
            emit({"code": None})
            return
    emit({"code": resp.code.dotted, "payload": resp.payload.hex()})


async def stream(ctx, uri, prefix, count):
    for i in range(count):
        msg = Message(code=POST, uri=uri, payload=f"{prefix}-{i}".encode())
        resp = await ctx.request(msg).response
        emit({"i": i, "code": resp.code.dotted})


async def observe(ctx, uri, n):
    req = ctx.request(Message(code=GET, uri=uri, observe=0))
    first = await req.response
    emit({"registered": first.code.dotted, "observe": first.opt.observe})
    seen = 0
    async for note in req.observation:
        emit({"payload": note.payload.hex(), "code": note.code.dotted})
        seen += 1
        if seen >= n:
            req.observation.cancel()
            break


async def main():
    ctx = await Context.create_client_context()
    try:
        mode = sys.argv[1]
        if mode == "publish":
            await publish(ctx, sys.argv[2], sys.argv[3], sys.argv[4])
        elif mode == "stream":
            await stream(ctx, sys.argv[2], sys.argv[3], int(sys.argv[4]))
        elif mode == "observe":
            await observe(ctx, sys.argv[2], int(sys.argv[3]))
        else:
            raise SystemExit(f"unknown mode {mode}")
    finally:
        await ctx.shutdown()


asyncio.run(main())
