"""`cargo xtask bench rstream`: the official rstream Python SDK as a contender.

Usage: python rstream_sdk.py '<json config>'

Config keys: engine, ca_file, token, target ("host:port"), uvloop (bool).
Connects to the engine, creates a published TCP tunnel, prints one JSON line
({"id", "version", "loop"}) and forwards every stream to target with the SDK's own
`forward_to` until stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys

import rstream
from rstream import Client
from rstream.config import TLSOptions


async def serve(cfg: dict) -> None:
    client = Client(
        engine=cfg["engine"],
        token=cfg["token"],
        tls=TLSOptions(ca_file=cfg["ca_file"]),
        read_config_file=False,
    )
    control = await client.connect()
    tunnel = await control.create_tunnel(protocol="tcp")
    loop = asyncio.get_running_loop()
    print(
        json.dumps(
            {
                "id": tunnel.id,
                "version": getattr(rstream, "__version__", None),
                "loop": type(loop).__module__ + "." + type(loop).__name__,
            }
        ),
        flush=True,
    )
    host, port = cfg["target"].rsplit(":", 1)
    forward = asyncio.create_task(tunnel.forward_to(host, int(port)))
    # Run until the bench closes our stdin.
    await loop.run_in_executor(None, sys.stdin.read)
    forward.cancel()
    await asyncio.gather(forward, return_exceptions=True)
    await client.close()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("uvloop"):
        import uvloop

        uvloop.run(serve(cfg))
    else:
        asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
