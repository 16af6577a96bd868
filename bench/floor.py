"""The floor of the device plugin's stack: a bare grpclib + betterproto server on a Unix socket.

It answers every ``Allocate`` with one canned ``AllocateResponse`` (decoding the request and
encoding the answer each time, as any grpclib service does) and nothing else: no validation, no
logging, no metrics. ``bench/bench_compare.py`` runs it in a process of its own next to the agent
as deployed, so that the agent's figures read as a ratio to what the stack costs by itself.

    python bench/floor.py SOCKET RESPONSE_FILE [--loop asyncio|uvloop] [--codec pure|rust]

``RESPONSE_FILE`` holds the serialized answer (the bench captures the agent's own answer for the
same request, so both servers send the same bytes). The process prints ``ready`` once it listens
and serves until SIGTERM. ``--codec pure`` (the default) keeps betterproto on its own Python
codec even where ``betterproto-rust-codec`` is installed: the floor is the stack as pinned.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpclib.server import Stream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CannedAllocate:
    def __init__(self, response: Any) -> None:
        self._response = response

    async def allocate(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        await stream.send_message(self._response)

    def __mapping__(self) -> dict[str, Any]:
        import grpclib.const

        from agent._proto.deviceplugin import v1beta1 as pb

        return {
            "/v1beta1.DevicePlugin/Allocate": grpclib.const.Handler(
                self.allocate, grpclib.const.Cardinality.UNARY_UNARY, pb.AllocateRequest, pb.AllocateResponse
            )
        }


async def serve(socket: str, response: Any, coalesce: bool = False) -> None:
    from grpclib.server import Server

    if coalesce:
        # the agent's protocol with grpclib's and h2's own settings: stock grpclib, one write per turn
        from agent.grpc.grpclib_adapter import Http2Settings, make_server

        server = make_server([CannedAllocate(response)], settings=Http2Settings())
    else:
        server = Server([CannedAllocate(response)])
    await server.start(path=socket)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    server.close()
    await server.wait_closed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket")
    parser.add_argument("response", type=Path)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--codec", choices=("pure", "rust"), default="pure")
    parser.add_argument(
        "--coalesce", action="store_true", help="one socket write per loop turn (agent.grpc.grpclib_adapter)"
    )
    args = parser.parse_args()
    if args.codec == "pure":
        sys.modules["betterproto_rust_codec"] = None  # type: ignore[assignment]  # betterproto's import fails
    from agent._proto.deviceplugin import v1beta1 as pb

    response = pb.AllocateResponse().parse(args.response.read_bytes())
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(serve(args.socket, response, args.coalesce))
    else:
        asyncio.run(serve(args.socket, response, args.coalesce))


if __name__ == "__main__":
    main()
