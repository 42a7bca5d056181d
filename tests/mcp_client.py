"""A real MCP client for `turnstile mcp`: the official MCP Python SDK (PyPI `mcp`, installed by
scripts/install-python-tools.sh), used by the integration test tests/tests/integration/mcp.rs.

usage: mcp_client.py TURNSTILE_BIN START_STEP_ARGUMENTS_JSON

Launches `TURNSTILE_BIN mcp` over stdio with this process's TURNSTILE_* variables (the
credentials and TURNSTILE_NATS_URL), initializes, lists the tools and checks that the four are
advertised with object input schemas, calls start_step with the given arguments, and prints
one JSON object to stdout: {"initialize": ..., "tools": [...], "start_step": ...}.
Exits non-zero with a message on stderr when a check fails.
"""

import json
import os
import sys

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

TOOLS = {"start_step", "start_agent", "step_status", "list_steps"}


def dump(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def main(binary, arguments):
    env = {k: v for k, v in os.environ.items() if k.startswith("TURNSTILE_")}
    server = StdioServerParameters(command=binary, args=["mcp"], env=env)
    with anyio.fail_after(60):
        async with stdio_client(server) as (read, write):
            async with ClientSession(read, write) as session:
                hello = await session.initialize()
                listed = await session.list_tools()
                tools = [dump(t) for t in listed.tools]
                names = {t["name"] for t in tools}
                if names != TOOLS:
                    sys.exit(f"tools advertised: {sorted(names)}, expected {sorted(TOOLS)}")
                for t in tools:
                    if t.get("inputSchema", {}).get("type") != "object":
                        sys.exit(f"tool {t['name']} has no object input schema: {t}")
                result = await session.call_tool("start_step", arguments)
    print(
        json.dumps(
            {"initialize": dump(hello), "tools": tools, "start_step": dump(result)}
        )
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    anyio.run(main, sys.argv[1], json.loads(sys.argv[2]))
