"""Finds Turnstile's NATS micro services the way any NATS client can, with nats-py (not
async-nats): `$SRV.PING` to find every instance, then `$SRV.INFO.<name>` for each service's
endpoints. Connects to TURNSTILE_NATS_URL (credentials in the URL) and prints one JSON
document on stdout: {"pings": [...], "infos": {name: [...]}}."""

import asyncio
import json
import os

import nats
from nats.errors import TimeoutError as NatsTimeout

# Every instance answers within this; the test's stack is local.
WAIT = 1.5


async def gather(nc, subject):
    """Every reply to one request on `subject` within WAIT seconds."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT
    replies = []
    while True:
        left = end - loop.time()
        if left <= 0:
            break
        try:
            msg = await sub.next_msg(timeout=left)
        except NatsTimeout:
            break
        replies.append(json.loads(msg.data))
    await sub.unsubscribe()
    return replies


async def main():
    nc = await nats.connect(os.environ["TURNSTILE_NATS_URL"])
    try:
        pings = await gather(nc, "$SRV.PING")
        infos = {}
        for name in sorted({p["name"] for p in pings}):
            infos[name] = await gather(nc, f"$SRV.INFO.{name}")
        print(json.dumps({"pings": pings, "infos": infos}))
    finally:
        await nc.close()


asyncio.run(main())
