"""Gradient reduction between the ranks that hold the same parameters.

Three kinds of group, all made once at compile time, identically on every rank:
- replicas: the devices of a data-parallel stage; every gradient of the stage is summed
  over them (each replica saw its share of the micro-batches);
- holders of a shared parameter: stages that each hold a copy of a tied weight (its canonical
  name is the same); the copies' gradients are summed, so the copies stay identical.
- copies of one tied weight on one rank (two stages of a pp rank under FSDP2, each stage an
  FSDP2 root of its own: `groups.own_copies`): their gradients are added locally, after
  FSDP2's reduce-scatter, before any group sums them, and every copy gets the result
  (`GradSync.copies`), so the copies step identically.
- the dp ranks of a stage kept whole under a mesh (a versioned weight policy, stash or 2bw:
  no FSDP2): each ran its slice of every micro-batch, so their gradients are averaged
  (`SyncGroup.mean`), once per weight version, at the policy's update.

There is one process group per set of ranks (`make_groups`), not per weight: groups on the
same ranks (two weights tied across the same stages, or a tied weight and the replicas of its
stage) share it, and `GradSync` sums them as one group, in one sequence of buckets.

A group's parameters are cut into buckets, in reverse registration order (the order a
backward produces their gradients), each at most `bucket_bytes` and of one dtype and device.
During a stage's last backward before an update the weight policy reports each parameter
whose gradient is final (`ready`; `FinalGrads` picks them and hooks them): from an autograd
hook as the gradient is accumulated, and the rest when the backward returns. A bucket whose
parameters are all ready is flattened and summed with an asynchronous all-reduce at once, so
the communication overlaps the rest of the backward (as DistributedDataParallel does):

    policy.backward(j, run, final)   hooks on `final` -> sync.ready(p, holder) -> launch
    policy.update(j) -> sync()       wait for the launched buckets, reduce the others now

`final_backwards(ops)` finds, in a rank's program, the backwards that get `final`. A
parameter that gets no gradient in that backward holds back its bucket, and the group's later
ones, until the backward returns.

Buckets of one group are launched strictly in order (bucket k after 0..k-1), so every member
issues the group's collectives in the same order; groups are separate process groups. A
bucket not launched by the update (a parameter that got no gradient, a step without `final`)
is reduced then, so the result never depends on what was overlapped: each `.grad` ends as
the sum over the group, None counting as zeros. A gradient that changes after its bucket was
launched (a parameter reported final too early) is refused at the update.

Each all-reduce is launched and waited for under `failures.guarded`, as every collective is.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from graphpipe._torch import tensor_version
from graphpipe.errors import FailureKind, PipelineError
from graphpipe.ir import Action, ActionKind
from graphpipe.runtime.failures import failure, guarded

__all__ = [
    "BUCKET_BYTES",
    "FinalGrads",
    "GradSync",
    "SyncGroup",
    "final_backwards",
    "laid_as",
    "local_part",
    "make_groups",
]

BUCKET_BYTES = 25 * 2**20  # the largest bucket (one parameter may exceed it alone)


@dataclass
class SyncGroup:
    """One all-reduce: a process group and the local parameters it sums."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None  # None when this rank is not a member
    params: list[nn.Parameter]
    label: str
    # the sum divided by the group's size: the dp slices of every micro-batch, each the
    # gradient of its slice's mean loss (a mesh's dp ranks of a whole stage; FSDP2's
    # reduce-scatter averages so too)
    mean: bool = False


def make_groups(
    memberships: Sequence[tuple[tuple[int, ...], str]], rank: int, timeout: float
) -> list[dist.ProcessGroup | None]:
    """The process group of each (ranks, label): one per set of ranks, made in order of
    first appearance, on every rank alike (`dist.new_group` is a collective of every rank,
    run under `guarded`).

    Memberships on the same ranks (in any order) get the same group object, so `GradSync`
    sums them together.

    Args:
        memberships: (ranks, label) per group of parameters, the same list on every rank.
        rank: This rank.
        timeout: Seconds the groups' collectives may take.

    Returns:
        Per membership, its process group; None where this rank is not a member.
    """
    made: dict[frozenset[int], dist.ProcessGroup] = {}
    groups: list[dist.ProcessGroup | None] = []
    for ranks, _ in memberships:
        key = frozenset(ranks)
        if key not in made:
            new = functools.partial(
                dist.new_group, sorted(key), timeout=datetime.timedelta(seconds=timeout)
            )
            made[key] = guarded(f"the creation of the group of ranks {sorted(key)}", new)
        groups.append(made[key] if rank in key else None)
    return groups


def merge_groups(groups: Sequence[SyncGroup]) -> list[SyncGroup]:
    """This rank's groups, those on one process group merged into one, in order.

    Merging is needed, not only cheaper: the collectives of one process group must be issued
    in the same order on every member, and one group's buckets are launched strictly in order.

    Args:
        groups: Every group; those this rank is not in (`group` None) or holds nothing of
            are dropped.

    Returns:
        One group per process group, its parameters in order (each once), labels joined.
    """
    merged: dict[int, SyncGroup] = {}
    for g in groups:
        if g.group is None or not g.params:
            continue
        first = merged.get(id(g.group))
        if first is None:
            merged[id(g.group)] = g
            continue
        if first.mean != g.mean:  # the dp groups share no ranks set with a tie or replicas
            raise ValueError(f"{first.label} and {g.label} share ranks but not their mean")
        held = {id(p) for p in first.params}
        params = first.params + [p for p in g.params if id(p) not in held]
        label = f"{first.label}, {g.label}"
        merged[id(g.group)] = SyncGroup(first.ranks, g.group, params, label, first.mean)
    return list(merged.values())


def final_backwards(ops: Sequence[Any]) -> frozenset[int]:
    """Positions in a rank's operations of each stage's last backward (B or W) before each
    update (U): after these a stage's gradients are final, so they get `final`.

    A backward whose update falls in a later list (the next call's) is not found: its
    gradients are then summed at the update, later but the same.

    Args:
        ops: A rank's program (Actions and communication groups, which have no `kind`).

    Returns:
        The positions, for `policy.backward(..., final=...)` and `policy.accumulate`.

    Example:
        >>> from graphpipe.ir import Action
        >>> ops = [Action.parse(t) for t in ("0F0", "0B0", "0F1", "0B1", "0U")]
        >>> sorted(final_backwards(ops))
        [3]
    """
    found: set[int] = set()
    last: dict[int, int] = {}  # stage -> position of its latest backward since the update
    for i, op in enumerate(ops):
        if not isinstance(op, Action):
            continue  # a communication group
        if op.kind.ends_backward:
            last[op.stage] = i
        elif op.kind == ActionKind.U:
            found.update(last.values())
            last.clear()
    return frozenset(found)


@dataclass
class _Bucket:
    """Parameters summed by one all-reduce, and its state in the current step."""

    params: list[nn.Parameter]
    holders: dict[int, torch.Tensor] = field(default_factory=dict)  # id(p) -> ready grad's owner
    flat: torch.Tensor | None = None  # the gradients, flattened, once launched
    work: Any = None  # the all-reduce in flight (dist.Work)
    seen: list[tuple[torch.Tensor | None, int]] = field(default_factory=list)  # grad, version
    error: PipelineError | None = None  # the launch failed

    def complete(self) -> bool:
        return len(self.holders) == len(self.params)

    def launched(self) -> bool:
        return self.flat is not None

    def reset(self) -> None:
        self.holders, self.flat, self.work, self.seen, self.error = {}, None, None, [], None


def _buckets(params: Sequence[nn.Parameter], cap: int) -> list[_Bucket]:
    """`params` reversed, cut before `cap` bytes or where the dtype or device changes."""
    out: list[_Bucket] = []
    size = 0
    for p in reversed(params):
        bytes_ = local_part(p).numel() * p.element_size()
        last = out[-1].params[-1] if out else None
        if last is None or size + bytes_ > cap or (last.dtype, last.device) != (p.dtype, p.device):
            out.append(_Bucket([]))
            size = 0
        out[-1].params.append(p)
        size += bytes_
    return out


class GradSync:
    """Sums gradients within every group this rank belongs to, bucket by bucket.

    Args:
        groups: Every group (those this rank is not in, or holds nothing of, are ignored;
            those on one process group are summed as one, `merge_groups`).
        bucket_bytes: The size at which a group's parameters are cut into buckets.
        copies: Copies of one tied weight held by this rank's stages, each list first copy
            first: at the update their gradients are added on this rank (local parts of one
            layout), the first copy's sum is then summed by its groups, and every copy gets
            the result. A copy is never reported ready early (`tracks` is False for it), so
            a bucket holding the first copy is launched at the update, after the local sum.

    Example (on every member of the groups; a process group is needed)::

        sync = GradSync(groups)
        sync.ready(p, p)  # p.grad is final: launches p's bucket once the bucket is complete
        sync()  # every .grad of the groups now holds the group's sum
    """

    def __init__(
        self,
        groups: Sequence[SyncGroup],
        bucket_bytes: int = BUCKET_BYTES,
        copies: Sequence[Sequence[nn.Parameter]] = (),
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        self.copies = [list(c) for c in copies]
        self._index(merge_groups(groups))

    def _index(self, groups: list[SyncGroup]) -> None:
        """Cut the groups into buckets and note where each parameter is summed."""
        self.groups = groups
        self.buckets = [_buckets(g.params, self.bucket_bytes) for g in self.groups]
        self._where: dict[int, list[tuple[int, int]]] = {}  # id(p) -> [(group, bucket)]
        for gi, buckets in enumerate(self.buckets):
            for bi, bucket in enumerate(buckets):
                for p in bucket.params:
                    self._where.setdefault(id(p), []).append((gi, bi))
        self._next = [0] * len(self.groups)  # per group: buckets launched this step
        self._copied = {id(p) for c in self.copies for p in c}

    def rebind(self, fresh: dict[int, nn.Parameter]) -> None:
        """Sum the parameters that replaced the groups' own (FSDP2's sharded ones, which
        `fully_shard` registers in the modules in place of the originals): `fresh` maps
        id(original) -> its replacement; a parameter not in it stays."""
        self.copies = [[fresh.get(id(p), p) for p in c] for c in self.copies]
        self._index(
            [
                SyncGroup(
                    g.ranks, g.group, [fresh.get(id(p), p) for p in g.params], g.label, g.mean
                )
                for g in self.groups
            ]
        )

    def broadcast(self) -> None:
        """Make every copy equal to its group's first rank's: tied copies and replicas that
        were initialised separately (a model materialised from the meta device)."""
        with torch.no_grad():
            for g in self.groups:
                for p in g.params:
                    guarded(
                        f"the broadcast of {g.label}",
                        functools.partial(
                            dist.broadcast, local_part(p), src=g.ranks[0], group=g.group
                        ),
                        g.ranks,
                    )

    def tracks(self, p: torch.Tensor) -> bool:
        """Whether `p` is summed by a group of this rank and may be reported ready early
        (not a copy of a weight tied on this rank: its copies are added at the update)."""
        return id(p) in self._where and id(p) not in self._copied

    def launched(self) -> int:
        """Buckets launched early in this step (the update waits for them)."""
        return sum(self._next)

    def ready(self, p: torch.Tensor, holder: torch.Tensor) -> None:
        """Mark p's gradient final for this step and launch the buckets that are complete.

        Args:
            p: A parameter of a group (others are ignored).
            holder: The tensor whose `.grad` holds p's gradient: p itself, or the version
                of p the backward ran on (moved into p.grad before the update).
        """
        if id(p) in self._copied:
            return  # added to its copies at the update first
        with self._lock:
            for gi, bi in self._where.get(id(p), ()):
                bucket = self.buckets[gi][bi]
                if not bucket.launched():
                    bucket.holders[id(p)] = holder
                self._launch_complete(gi)

    def _launch_complete(self, gi: int) -> None:
        """Launch group gi's next buckets, in order, while they are complete."""
        buckets = self.buckets[gi]
        while self._next[gi] < len(buckets) and buckets[self._next[gi]].complete():
            self._launch(gi, buckets[self._next[gi]])
            self._next[gi] += 1

    def _launch(self, gi: int, bucket: _Bucket) -> None:
        """Flatten the bucket's gradients and start their all-reduce."""
        owners = [bucket.holders.get(id(p), p) for p in bucket.params]
        grads = [h.grad for h in owners]
        bucket.seen = [(g, -1 if g is None else tensor_version(local_part(g))) for g in grads]
        parts = [
            (
                local_part(laid_as(g, p)) if g is not None else torch.zeros_like(local_part(p))
            ).reshape(-1)
            for g, p in zip(grads, bucket.params, strict=True)
        ]
        bucket.flat = torch.cat(parts)
        g = self.groups[gi]
        launch = functools.partial(dist.all_reduce, bucket.flat, group=g.group, async_op=True)
        try:
            bucket.work = guarded(f"the launch of the all-reduce of {g.label}", launch, g.ranks)
        except PipelineError as exc:  # raised at the update, not inside autograd
            bucket.error = exc

    def __call__(self) -> None:
        """Finish the step's reduction: every `.grad` of a group becomes the group's sum.

        Raises:
            PipelineError: an all-reduce failed or timed out, or a gradient changed after
                its bucket was launched; naming the group and its ranks.
        """
        try:
            for c in self.copies:
                _add_copies(c)
            for gi in range(len(self.groups)):
                for bucket in self.buckets[gi]:
                    if not bucket.launched():
                        bucket.holders = {}  # the gradients now live in p.grad
                        self._launch(gi, bucket)
                    self._finish(self.groups[gi], bucket)
            for c in self.copies:
                _share_copies(c)
        finally:
            for buckets in self.buckets:
                for bucket in buckets:
                    bucket.reset()
            self._next = [0] * len(self.groups)

    def _finish(self, g: SyncGroup, bucket: _Bucket) -> None:
        """Wait for the bucket's all-reduce and write the sums into `.grad`."""
        if bucket.error is not None:
            raise bucket.error
        assert bucket.flat is not None and bucket.work is not None
        # on CUDA the wait makes this thread's stream wait: it must run here
        here = bucket.flat.device.type == "cuda"
        guarded(f"the all-reduce of {g.label}", bucket.work.wait, g.ranks, here=here)
        position = {id(p): i for i, p in enumerate(g.params)}
        changed = [
            position[id(p)]
            for p, (grad, version) in zip(bucket.params, bucket.seen, strict=True)
            if p.grad is not grad
            or (grad is not None and tensor_version(local_part(grad)) != version)
        ]
        if changed:
            raise failure(
                f"gradients of {g.label} over ranks {list(g.ranks)} changed after their "
                f"all-reduce was launched: its parameters {sorted(changed)} (by position) "
                "were reported final before their last backward",
                FailureKind.BROKEN,
                peers=g.ranks,
            )
        assert bucket.flat is not None
        if g.mean:
            bucket.flat.div_(len(g.ranks))
        at = 0
        for p in bucket.params:
            n = local_part(p).numel()
            p.grad = _like(p, bucket.flat[at : at + n].view_as(local_part(p)).clone())
            at += n


def _add_copies(copies: Sequence[nn.Parameter]) -> None:
    """The first copy's gradient becomes the sum of every copy's (None counting as zeros):
    local parts of one layout (each laid out as its parameter, `laid_as`), added on this
    rank, so that the copies of one weight on one rank sum as one tensor's gradient would."""
    grads = [laid_as(p.grad, p) for p in copies if p.grad is not None]
    if not grads:
        return
    total = local_part(grads[0]).clone()
    for g in grads[1:]:
        total.add_(local_part(g))
    copies[0].grad = _like(copies[0], total)


def _share_copies(copies: Sequence[nn.Parameter]) -> None:
    """Every copy gets the first copy's (summed) gradient, a tensor of its own (clipping
    scales each gradient in place)."""
    first = copies[0].grad
    for p in copies[1:]:
        p.grad = None if first is None else _like(p, local_part(first).clone())


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (FSDP2, tp), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def laid_as(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`grad` in the layout of its parameter `p`, so that local parts of one layout are
    summed: a DTensor gradient placed otherwise than `p` (under tp without FSDP2, a
    replicated weight's gradient is Partial over tp where a split layer's backward fed it:
    each tp rank holds a part of the sum) redistributed to `p`'s placements, a collective
    over `p`'s mesh, run alike by its ranks; any other gradient as it is. (FSDP2 lays the
    gradients it reduces out so itself.)"""
    if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as p's gradient: a DTensor laid out as p when p is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return local


Picked = list[tuple[nn.Parameter, torch.Tensor]]  # (parameter, the tensor its .grad is in)


class FinalGrads:
    """Reports to a GradSync the gradients that a stage's last backward makes final.

    A parameter held by several of the rank's stages (a tied weight) is named in the `final`
    of each stage's last backward; it is reported only in the last of those calls, after
    every stage holding it has added its gradient.

    Args:
        sync: The rank's GradSync.
        parts: The rank's stage modules.
    """

    def __init__(self, sync: GradSync, parts: Sequence[nn.Module]) -> None:
        self.sync = sync
        self._holders = Counter(id(p) for part in parts for p in part.parameters())
        self._named: Counter[int] = Counter()  # `final` calls naming each param since clear()

    def pick(
        self, final: Sequence[nn.Parameter], owner: Callable[[nn.Parameter], torch.Tensor]
    ) -> Picked:
        """The parameters of `final` that are summed and in their last `final` call, each
        with `owner(p)`, the tensor whose `.grad` holds its gradient."""
        out = []
        for p in {id(p): p for p in final}.values():
            self._named[id(p)] += 1
            if self._named[id(p)] >= self._holders.get(id(p), 1) and self.sync.tracks(p):
                out.append((p, owner(p)))
        return out

    @contextmanager
    def hooked(self, picked: Picked) -> Iterator[None]:
        """Report each picked parameter when its owner's gradient is accumulated (a
        post-accumulate-grad hook), and every one once the block ends: a gradient that did
        not come is final too."""
        handles = [
            owner.register_post_accumulate_grad_hook(lambda t, p=p: self.sync.ready(p, t))
            for p, owner in picked
            if owner.requires_grad
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self.report(picked)

    def report(self, picked: Picked) -> None:
        """Report the picked parameters final (a repeat is harmless)."""
        for p, owner in picked:
            self.sync.ready(p, owner)

    def clear(self) -> None:
        """A new step: no `final` call seen."""
        self._named.clear()
