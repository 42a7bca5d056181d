#!/usr/bin/env python3
"""Follow one Turnstile session from outside: each run, turn and step of it, as it happens.

Subscribes to the session's lifecycle events (`ts.events.session.<session>.>`, see
docs/events.md) with the NATS Python client (`pip install nats-py`) and prints one line per
run, turn and step event. It needs only read access to `ts.events.>`: the observer identity.

    TURNSTILE_NATS_URL=nats://observer:PASSWORD@localhost:4222 \\
        python3 examples/follow_session.py ses_...

`--until KIND` stops after the first event of that kind (for example `run.completed`);
`--timeout SECONDS` gives up (exit status 1) if it has not come by then.
"""

import argparse
import asyncio
import json
import os
import sys

import nats

# The envelope version this reader understands (docs/events.md); others are reported, skipped.
ENVELOPE_VERSION = 1


def describe(env):
    """One line for a run, turn or step event; None for the session's other events."""
    kind = env.get("type", "")
    data = env.get("data") or {}
    area, _, what = kind.partition(".")
    if area == "run":
        extra = ""
        if what == "round":
            extra = f" message {data.get('message_index')} turn {data.get('turn')}"
        elif what in ("completed", "failed"):
            state = data.get("state") or {}
            extra = f" ({state.get('reason', 'ok')})" if what == "failed" else ""
        return f"run  {data.get('run')} {what}{extra}"
    if area == "turn":
        reason = f" ({data.get('reason')})" if what == "failed" else ""
        return f"turn {env.get('turn')} {what}{reason}"
    if area == "step":
        parent = data.get("parent")
        under = f" under {parent}" if parent else ""
        return f"step {data.get('execution')} {what} {data.get('name', '')}{under}"
    return None


async def follow(url, session, until, timeout):
    nc = await nats.connect(url)
    done = asyncio.Event()

    async def on_event(msg):
        try:
            env = json.loads(msg.data)
        except ValueError:
            print(f"unreadable event on {msg.subject}", file=sys.stderr)
            return
        if env.get("v") != ENVELOPE_VERSION:
            print(f"event version {env.get('v')} not understood; skipped", file=sys.stderr)
            return
        line = describe(env)
        if line:
            print(f"{env.get('at', '')} {line}", flush=True)
        if until and env.get("type") == until:
            done.set()

    await nc.subscribe(f"ts.events.session.{session}.>", cb=on_event)
    await nc.flush()
    print(f"following {session}", flush=True)
    try:
        await asyncio.wait_for(done.wait(), timeout)
        return 0
    except asyncio.TimeoutError:
        print(f"no {until} within {timeout} s", file=sys.stderr)
        return 1
    finally:
        await nc.drain()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("session", help="the session id (ses_...)")
    p.add_argument("--until", help="stop after the first event of this kind")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for --until")
    a = p.parse_args()
    url = os.environ.get("TURNSTILE_NATS_URL", "nats://localhost:4222")
    timeout = a.timeout if a.until else None
    sys.exit(asyncio.run(follow(url, a.session, a.until, timeout)))


if __name__ == "__main__":
    main()
