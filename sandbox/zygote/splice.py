"""Moving a call's bytes kernel to kernel: splice between pipes and memfds, a call's output
streams (Sink, capped), and results framed onto the result pipe. No byte of a call's code,
stdin or output passes through the zygote's (Python) memory.
Imported as a top-level sibling by zygote/main.py (no package inside the zygote: see its docstring)."""

import os
import struct

from . import wire


def splice_exact(src, dst, n, *, offset_src=None):
    """Move n bytes from src to dst in the kernel (one end a pipe). Never through this process."""
    moved = 0
    while moved < n:
        if offset_src is None:
            step = os.splice(src, dst, n - moved)
        else:
            step = os.splice(src, dst, n - moved, offset_src=offset_src + moved)
        if step == 0:
            raise EOFError(f"end of input after {moved} of {n} bytes")
        moved += step


CELL_HEADER = struct.Struct(">II")  # a cell's body length, and how much of it is stdin


def forward_cell(job_fd, dst, n, stdin_n):
    """A framed body of n bytes (stdin_n of them stdin) from the job pipe to `dst` (a pipe), by
    splice. If `dst` is gone, the rest is dropped so the job pipe stays at a message boundary;
    False then."""
    moved = 0
    try:
        os.write(dst, CELL_HEADER.pack(n, stdin_n))
        while moved < n:
            step = os.splice(job_fd, dst, n - moved)
            if step == 0:
                raise EOFError("the job pipe closed mid-body")
            moved += step
        return True
    except OSError:
        splice_exact(job_fd, devnull(), n - moved)
        return False


def send_result(result_fd, header, out=(None, 0), err=(None, 0)):
    """A result header, then the bytes of each (memfd, length): spliced, never read here."""
    wire.write_msg(result_fd, {**header, "stdout": out[1], "stderr": err[1]})
    for fd, n in (out, err):
        if n:
            splice_exact(fd, result_fd, n, offset_src=0)


class Sink:
    """A call's stream: its pipe's bytes spliced into a memfd, kept up to cap + 1 (the byte past the
    cap proves the overflow); past that, spliced into /dev/null so the writer never blocks."""

    def __init__(self, pipe_r, cap):
        self.pipe_r, self.cap = pipe_r, cap
        os.set_blocking(pipe_r, False)
        self.memfd = os.memfd_create("out", 0)
        self.size = 0
        self.open = True

    def drain(self):
        """Move what the pipe holds now; True once over the cap."""
        while self.open:
            room = self.cap + 1 - self.size
            dst = self.memfd if room > 0 else devnull()
            try:
                step = os.splice(self.pipe_r, dst, room if room > 0 else 1 << 16, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                break
            if step == 0:
                self.open = False
                break
            if room > 0:
                self.size += step
        return self.size > self.cap

    @property
    def kept(self):
        return (self.memfd, min(self.size, self.cap))

    def close(self):
        os.close(self.memfd)


DEVNULL = []


def devnull():
    if not DEVNULL:
        DEVNULL.append(os.open("/dev/null", os.O_WRONLY))
    return DEVNULL[0]

