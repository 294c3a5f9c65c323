"""Communication: one message per stage edge and micro-batch, with timeouts that name the peer.

A message carries every tensor an edge carries for one micro-batch (activations forward,
gradients backward). One tensor goes as its own bytes and is received into a tensor of its
own: no copy on either side. Several are packed into one byte buffer, each tensor 8-byte
aligned, and copied out of it on arrival. The messages of one communication group of the
program (`graphpipe.scheduling.program`) are issued together, as one `batch_isend_irecv`.
The receiver
knows the shapes and dtypes in advance (`stage.micro_shapes`), so it allocates the tensor or
buffer before the data arrives. An edge that carries nothing (a sequential chain's
dependency) sends a one-byte token.

On the CPU the transport keeps the packing buffers of finished messages (`Buffers`) and gives
them to later messages of the same size: a fresh buffer of many megabytes is new memory from
the operating system, whose every page faults and is zeroed at its first write, host work as
long as the copy itself. A pipeline sends the same sizes every step, so after the first step
no message buffer is new. On CUDA the caching allocator already reuses device memory.

Tags keep channels apart on transports that match by tag (gloo): bits 20 and up name the edge
and direction, the low 20 bits the micro-batch. NCCL ignores tags and matches the k-th send
from a rank to a peer with the peer's k-th receive from it; the program issues every message
in one global order on all ranks, so the two agree.

On the CPU every wait runs under the rank's `Watch` (`graphpipe.runtime.failures`): it has a
timeout, and it stops at once when another rank posts a failure. On CUDA a wait makes the
compute stream wait for the message and returns at once; the process group's timeout and
watchdog bound it. A timeout, a peer that closed its connection (it died) or a failure posted
elsewhere raises `PipelineError` (kind TIMED_OUT, DIED or ECHO) naming this rank, the schedule
action, the peer and the rank that failed first.
"""

from __future__ import annotations

import datetime
import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphpipe.runtime.failures import BACKSTOP, Watch, unwatched_error

__all__ = [
    "Buffers",
    "Incoming",
    "Outgoing",
    "Pending",
    "Spec",
    "Transport",
    "outgoing",
    "pack",
    "tag_for",
    "unpack",
]

Spec = tuple[tuple[int, ...], torch.dtype]  # shape, dtype
ALIGN = 8


def tag_for(edge: int, backward: bool, mb: int) -> int:
    """The tag of micro-batch `mb`'s message on edge number `edge`."""
    return ((edge * 2 + int(backward)) << 20) | (mb & 0xFFFFF)


def _nbytes(spec: Spec) -> int:
    shape, dtype = spec
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty((), dtype=dtype).element_size()


def _offsets(specs: Sequence[Spec]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for spec in specs:
        offsets.append(at)
        at += -(-_nbytes(spec) // ALIGN) * ALIGN
    return offsets, max(at, 1)


class Buffers:
    """Message buffers, handed back when their message is done and reused on the CPU.

    The pool holds only buffers that were all in use at once, so it never holds more bytes
    than the most that messages held at one time.

    Args:
        device: Where buffers live; only CPU buffers are reused (see the module docstring).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reuse = device.type == "cpu"
        self.made = 0  # buffers allocated so far
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` (contents undefined)."""
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.made += 1
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buffer: torch.Tensor) -> None:
        """`buffer`'s message is done: keep it for the next message of its size."""
        if self.reuse:
            self._free[buffer.numel()].append(buffer)

    @property
    def pooled_bytes(self) -> int:
        """Bytes held for reuse."""
        return sum(b.numel() for free in self._free.values() for b in free)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as a flat uint8 view (a copy first if `t` is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def outgoing(tensors: Sequence[torch.Tensor], buffers: Buffers) -> tuple[torch.Tensor, bool]:
    """What goes on the wire for a message: one tensor's own bytes (no copy), or several
    packed into a buffer from `buffers`. Returns it and whether it is a pool buffer."""
    if len(tensors) == 1:
        return _bytes(tensors[0]), False
    return pack(tensors, buffers), True


def pack(tensors: Sequence[torch.Tensor], buffers: Buffers) -> torch.Tensor:
    """The tensors' bytes in one aligned uint8 buffer from `buffers` (one byte for no
    tensors; padding bytes undefined)."""
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    offsets, total = _offsets(specs)
    buffer = buffers.take(total)
    for t, at in zip(tensors, offsets, strict=True):
        raw = _bytes(t)
        buffer[at : at + raw.numel()] = raw
    return buffer


def unpack(buffer: torch.Tensor, specs: Sequence[Spec]) -> list[torch.Tensor]:
    """Inverse of `pack`, given the shapes and dtypes: tensors of their own (the buffer can be
    reused at once)."""
    offsets, _ = _offsets(specs)
    out = []
    for (shape, dtype), at in zip(specs, offsets, strict=True):
        size = _nbytes((shape, dtype))
        out.append(buffer[at : at + size].view(dtype).reshape(shape).clone())
    return out


@dataclass
class Pending:
    """A posted receive: its buffer, the work handles that complete it, and what it is for.
    A one-tensor message is received into its tensor (`direct`), with no buffer to unpack."""

    buffer: torch.Tensor
    works: list[dist.Work]
    specs: list[Spec]
    peer: int
    what: str
    direct: torch.Tensor | None = None


@dataclass
class Outgoing:
    """A message to send: its tensors, the peer rank, its tag and the action it is for."""

    tensors: Sequence[torch.Tensor]
    peer: int
    tag: int
    what: str


@dataclass
class Incoming:
    """A message to receive: its shapes and dtypes, the peer rank, its tag and action."""

    specs: Sequence[Spec]
    peer: int
    tag: int
    what: str


class Transport:
    """Point-to-point messages of one rank, with a timeout on every wait.

    Args:
        rank: This rank.
        timeout: Seconds any wait may take.
        device: Where buffers live.
        watch: Runs the waits and posts failures (none: plain waits with a timeout).
        rank_of: A message's peer (a plan device) -> its global rank; None: the same
            (no mesh; `graphpipe.runtime.mesh.ParallelLayout.rank_of`).
    """

    def __init__(
        self,
        rank: int,
        timeout: float,
        device: torch.device,
        watch: Watch | None = None,
        rank_of: Callable[[int], int] | None = None,
    ) -> None:
        self.rank, self.timeout, self.device, self.watch = rank, timeout, device, watch
        self.rank_of = rank_of or (lambda device: device)
        # (works, peer, action, what the send reads until done, whether it is a pool buffer)
        self._sends: list[tuple[list[dist.Work], int, str, torch.Tensor, bool]] = []
        self.buffers = Buffers(device)

    def exchange(self, sends: Sequence[Outgoing], receives: Sequence[Incoming]) -> list[Pending]:
        """Issue one communication group: every message in one `batch_isend_irecv`.

        Returns:
            The receives, in order; `wait` returns their tensors. The sends complete in the
            background (see `finish_sends`).
        """
        if not sends and not receives:
            return []
        ops: list[dist.P2POp] = []
        buffers: list[torch.Tensor] = []
        pooled: list[bool] = []
        direct: list[torch.Tensor | None] = []
        for m in sends:
            buffer, from_pool = outgoing(m.tensors, self.buffers)
            buffers.append(buffer)
            pooled.append(from_pool)
            ops.append(dist.P2POp(dist.isend, buffer, self.rank_of(m.peer), tag=m.tag))
        for r in receives:
            if len(r.specs) == 1:  # into its own tensor: nothing to unpack
                shape, dtype = r.specs[0]
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                direct.append(tensor)
                buffers.append(_bytes(tensor))
            else:
                direct.append(None)
                buffers.append(self.buffers.take(_offsets(r.specs)[1]))
            ops.append(dist.P2POp(dist.irecv, buffers[-1], self.rank_of(r.peer), tag=r.tag))
        messages: list[Outgoing | Incoming] = [*sends, *receives]
        what = ", ".join(m.what for m in messages)
        works = self._posted(ops, [self.rank_of(m.peer) for m in messages], what)
        # gloo answers one work per operation; NCCL one for the whole coalesced group
        per_op = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)
        for m, buffer, from_pool, w in zip(sends, buffers, pooled, per_op, strict=False):
            # a message's own tensor is held until its send completes, never pooled
            self._sends.append((w, self.rank_of(m.peer), m.what, buffer, from_pool))
        received = zip(receives, buffers[len(sends) :], per_op[len(sends) :], direct, strict=True)
        return [
            Pending(b, w, list(r.specs), self.rank_of(r.peer), r.what, d) for r, b, w, d in received
        ]

    def wait(self, pending: Pending) -> list[torch.Tensor]:
        """The received tensors, once they arrive (on CUDA: once the compute stream has been
        made to wait for them; the host does not block)."""
        return self.wait_all([pending])[0]

    def wait_all(self, pendings: Sequence[Pending]) -> list[list[torch.Tensor]]:
        """`wait` for each of `pendings`, in order (their waits handed to the watch at once)."""
        self._wait([(w, p.peer, p.what) for p in pendings for w in p.works])
        return [self._arrived(p) for p in pendings]

    def _arrived(self, pending: Pending) -> list[torch.Tensor]:
        """A completed receive's tensors."""
        if pending.direct is not None:
            return [pending.direct]
        tensors = unpack(pending.buffer, pending.specs)
        self.buffers.give(pending.buffer)
        return tensors

    def finish_sends(self) -> None:
        """Wait for every posted send; they hold their buffers until then."""
        sends, self._sends = self._sends, []
        self._wait([(w, peer, what) for works, peer, what, _, _ in sends for w in works])
        for _, _, _, buffer, pooled in sends:
            if pooled:
                self.buffers.give(buffer)

    def _posted(self, ops: list[dist.P2POp], peers: list[int], what: str) -> list[dist.Work]:
        try:
            return list(dist.batch_isend_irecv(ops))
        except RuntimeError as exc:  # e.g. a peer that died closed its connection
            if self.watch is not None:
                raise self.watch.failed(sorted(set(peers)), f"action {what}", exc) from exc
            head = f"rank {self.rank}, action {what}, peer rank {sorted(set(peers))}: "
            raise unwatched_error(head, self.rank, sorted(set(peers)), exc) from exc

    def _wait(self, works: Sequence[tuple[dist.Work, int, str]]) -> None:
        """Wait for each `(work, peer, action)` in order: on CUDA a stream dependency (the
        process group's own timeout and watchdog bound it), else under the watch."""
        if self.device.type == "cuda":
            for work, _, _ in works:
                work.wait()
            return
        if self.watch is not None:
            # gloo's own limit comes after the watch's, which diagnoses the timeout
            limit = datetime.timedelta(seconds=self.timeout + BACKSTOP)
            waits = [(functools.partial(w.wait, limit), [p], f"action {a}") for w, p, a in works]
            self.watch.wait_each(waits)
            return
        for work, peer, what in works:
            try:
                work.wait(datetime.timedelta(seconds=self.timeout))
            except RuntimeError as exc:
                head = f"rank {self.rank}, action {what}, peer rank {peer}: "
                raise unwatched_error(head, self.rank, [peer], exc) from exc
