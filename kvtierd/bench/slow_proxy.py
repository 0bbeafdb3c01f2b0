"""A TCP proxy on loopback that holds each call `delay_ms` before passing it to the server (the first bytes a
client sends after the server last answered it; a large value sent in many reads is held once), for
`kvtierd bench stall`'s slow Redis. It runs as a process of its own, so the values it relays take none of the
bench's CPU time: the bench times the streams' tokens as they arrive.

    python -m kvtierd.bench.slow_proxy TARGET_PORT DELAY_MS    (prints the port it listens on, then serves)
"""

from __future__ import annotations

import asyncio
import sys


async def _serve(target_port: int, delay_s: float, client_r: asyncio.StreamReader,
                 client_w: asyncio.StreamWriter) -> None:
    try:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
    except OSError:
        client_w.close()
        return
    answered = [True]  # the server answered since the client last sent: its next bytes are a new call

    async def up() -> None:
        while data := await client_r.read(1 << 16):
            if answered[0]:
                answered[0] = False
                await asyncio.sleep(delay_s)
            server_w.write(data)
            await server_w.drain()
        server_w.close()

    async def down() -> None:
        while data := await server_r.read(1 << 16):
            answered[0] = True
            client_w.write(data)
            await client_w.drain()
        client_w.close()

    await asyncio.gather(up(), down(), return_exceptions=True)


async def _main(target_port: int, delay_s: float) -> None:
    server = await asyncio.start_server(lambda r, w: _serve(target_port, delay_s, r, w), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), float(sys.argv[2]) / 1e3))
