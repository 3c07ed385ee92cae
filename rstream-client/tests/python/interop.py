"""Drives the official rstream Python SDK against the Rust LocalEngine.

Usage: python interop.py own  '<json config>'   # create tunnels and forward them until stdin closes
       python interop.py dial '<json config>'   # dial a private tunnel and check an echo

Config keys: engine, ca_file, token, and per mode:
  own:  tcp_target, http_target, private_target ("host:port"), private_name
  dial: tunnel, size, zero_rtt
Every result is printed as one JSON line on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import rstream
from rstream import Client
from rstream.config import TLSOptions


def make_client(cfg: dict, **extra) -> Client:
    return Client(
        engine=cfg["engine"],
        token=cfg["token"],
        tls=TLSOptions(ca_file=cfg["ca_file"]),
        read_config_file=False,
        heartbeat_interval=1.0,
        operation_timeout=10.0,
        connect_timeout=10.0,
        **extra,
    )


def split(target: str) -> tuple[str, int]:
    host, port = target.rsplit(":", 1)
    return host, int(port)


def describe(tunnel) -> dict:
    props = tunnel.properties
    return {
        "id": tunnel.id,
        "forwarding_address": tunnel.forwarding_address,
        "hostname": props.hostname,
        "port": props.port,
        "protocol": props.protocol,
        "publish": props.publish,
        "type": props.type,
    }


async def own(cfg: dict) -> None:
    client = make_client(cfg)
    control = await client.connect()
    tcp = await control.create_tunnel(protocol="tcp", labels={"sdk": "python"})
    http = await control.create_tunnel(protocol="http", name="py-http", http_version="http/1.1")
    private = await control.create_tunnel(name=cfg["private_name"], publish=False)
    print(
        json.dumps(
            {
                "version": getattr(rstream, "__version__", None),
                "server_agent": control.server_details.agent if control.server_details else None,
                "tcp": describe(tcp),
                "http": describe(http),
                "private": describe(private),
            }
        ),
        flush=True,
    )
    forwarders = [
        asyncio.create_task(tcp.forward_to(*split(cfg["tcp_target"]))),
        asyncio.create_task(http.forward_to(*split(cfg["http_target"]))),
        asyncio.create_task(private.forward_to(*split(cfg["private_target"]))),
    ]
    # Run until the Rust test closes our stdin.
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    for task in forwarders:
        task.cancel()
    await asyncio.gather(*forwarders, return_exceptions=True)
    await client.close()
    print(json.dumps({"closed": True}), flush=True)


async def dial(cfg: dict) -> None:
    client = make_client(cfg, zero_rtt=cfg.get("zero_rtt", True))
    payload = os.urandom(cfg["size"])
    stream = await client.dial(cfg["tunnel"])
    stream.write(payload)
    await stream.drain()
    echoed = await asyncio.wait_for(stream.readexactly(len(payload)), timeout=20)
    stream.close()
    await stream.wait_closed()
    await client.close()
    print(json.dumps({"ok": echoed == payload, "bytes": len(echoed)}), flush=True)


def main() -> None:
    mode, raw = sys.argv[1], sys.argv[2]
    cfg = json.loads(raw)
    asyncio.run(own(cfg) if mode == "own" else dial(cfg))


if __name__ == "__main__":
    main()
