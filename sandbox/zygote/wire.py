"""The wire format between the service (pool.py) and its zygote's workers (zygote/main.py): a message
is a 4-byte big-endian length and that many bytes of JSON. One implementation for both sides: the
zygote imports it as a top-level sibling (no package inside the zygote), the service as
`sandbox.zygote.wire`."""

from __future__ import annotations

import json
import os
import struct

LENGTH = struct.Struct(">I")


def encode(obj) -> bytes:
    body = json.dumps(obj).encode()
    return LENGTH.pack(len(body)) + body


def write_msg(fd: int, obj) -> None:
    view = memoryview(encode(obj))
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int) -> bytes | None:
    """n bytes from fd (blocking), None at end of input."""
    chunks = []
    while n:
        try:
            chunk = os.read(fd, n)
        except InterruptedError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_msg(fd: int):
    """The next message from fd (blocking), None at end of input."""
    header = read_exact(fd, LENGTH.size)
    if header is None:
        return None
    body = read_exact(fd, LENGTH.unpack(header)[0])
    return None if body is None else json.loads(body)


async def read_msg_async(reader):
    """The next message from an asyncio.StreamReader (IncompleteReadError at end of input)."""
    header = await reader.readexactly(LENGTH.size)
    return json.loads(await reader.readexactly(LENGTH.unpack(header)[0]))
