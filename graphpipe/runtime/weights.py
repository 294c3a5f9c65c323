"""Weight policies: which weights each forward and backward uses, and when the optimizer steps.

One small object per stage and rank. The executor runs every pass through it and hands it
every update action (`U`) of the schedule:

    policy.forward(j, run)       run(weights) for micro-batch j; weights None = the live ones
    policy.recompute(j, run)     (PipeMare) the forward again, with the backward's weights
    policy.backward(j, run, final)   run() the backward of micro-batch j
    policy.accumulate(run, final)    run(on_grad): the zero-bubble weight half, by hand
    policy.update(j)             the schedule's update action (j is None when flushed)

`final` names the parameters whose gradients are complete for the coming update once `run`
returns: the executor passes a stage's parameters on that stage's last backward (B, or the
last W) before the update, () otherwise (`sync.final_backwards` finds them). Under flush and
2bw, while that backward runs, each such parameter that is summed over replicas or tied
copies is reported to the `GradSync` (`FinalGrads`, `sync.ready`) as its gradient is accumulated: an
autograd post-accumulate-grad hook for a backward, the `on_grad` callback for the weight
half, which adds gradients by hand; those not accumulated are reported when `run` returns.
Complete buckets start their all-reduce at once, overlapping the rest of the backward; the
update waits for them and reduces whatever was not launched, so the sums are the same either
way. A parameter held by several of the rank's stages (a tied weight; `module` is then an
nn.ModuleList of the stage modules) is reported only in the last of its `final` calls, when
every stage holding it has finished. stash and pipemare update after every micro-batch, on
unreplicated stages (only tied copies are summed, and under a mesh a stash stage's dp
ranks): they ignore `final` and reduce at the update, synchronously.

Under a ("pp", "dp") mesh the versioned policies (stash, 2bw: `versioned`) keep each dp
rank's stage whole, not FSDP2-sharded (a version is an alias of whole weight tensors): each
dp rank runs its slice of every micro-batch on the same version, and the `GradSync` averages
the slices' gradients over the stage's dp ranks at each update (`graphpipe.runtime.groups`),
so an update is the one the whole micro-batches would make.

Letters: j a micro-batch, M micro-batches per step() call, w the stage's warm-up (forwards
before its first backward; `graphpipe.scheduling.generators.warmups`), k the updates applied so far.

    flush     One version. The gradients of the M micro-batches accumulate (each loss scaled
              by 1/M); one step per mini-batch after summing over replicas and tied copies:
              gradient accumulation, equal to one step on the mini-batch's mean loss.
    stash     PipeDream. Asynchronous 1F1B, no flush: every micro-batch is its own update
              (loss not scaled). A forward uses the newest weights; that version is kept for
              the same micro-batch's backward. At stage i micro-batch j sees the weights after
              max(0, j - w_i) updates: w(j+1) = w(j) - lr * grad f(w_1(j - w_1), ..., w_n(j - w_n)).
              At most w + 1 copies per stage, the live one included; one optimizer, no copies
              of its state.
    2bw       PipeDream-2BW. Gradients of a whole mini-batch (M >= depth micro-batches, loss
              scaled by 1/M) coalesce into one update, made after its last backward. The
              forwards of mini-batch t use version V_t, the live weights at its first forward
              or before update t-1, whichever comes first (on the last stage the update comes
              first): V_0 = V_1 = W0 and V_(t+2) = step(V_(t+1), grad f(V_t)), that is
              W(t+1) = W(t) - lr * grad f(W(t-1)), momentum and Adam included, with no shadow
              optimizer state. At most 2 copies.
    pipemare  PipeMare. Asynchronous 1F1B without stashing: a forward uses the live weights
              (k = j - w updates old), the backward re-runs the stage's forward on the saved
              input with the live weights, optionally corrected back towards the forward's:
              w - (tau_fwd - tau_bwd) * delta = w - w_i * delta, delta an exponential moving
              average of the weight steps. Learning rate rescheduling scales the rate by
              1 / tau^(1 - min(k / K, 1)), tau = max(w_i, 1). Both fixes can be switched off.
              One copy of the weights (plus delta, and the corrected weights while a
              backward runs). The forward updates buffers (BatchNorm's statistics) once; the
              recompute runs on copies of them, dropped.

How step() calls map to updates: flush and the synchronous schedules update once per call.
The asynchronous schedules (async, 2bw) keep micro-batches in flight across calls: call c
forwards micro-batches cM..cM+M-1 and runs the backwards and updates that fall due; step()
returns the mean loss of the micro-batches forwarded by this call. `drain()` (and
state_dict()) finish the backwards still in flight; the next step() starts a new warm-up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from graphpipe.ir.registry import POLICIES, PolicyOptions, policy_spec
from graphpipe.runtime.sync import FinalGrads, GradSync

__all__ = [
    "CLASSES",
    "Flush",
    "PipeMare",
    "PolicyOptions",
    "Stash",
    "TwoBW",
    "UpdateHook",
    "WeightPolicy",
    "make_policy",
]

T = TypeVar("T")
LOG = 4096  # micro-batches whose weight versions `log` keeps
Weights = dict[str, torch.Tensor] | None
OnGrad = Callable[[torch.Tensor], None]  # called with a tensor once its .grad was added to
# runs after the gradient sums, before the optimizer step; False skips the step (on every
# rank alike) and drops the gradients (`graphpipe.runtime.hooks`)
UpdateHook = Callable[[], bool]


class WeightPolicy:
    """Base class: the live parameters for everything, one step per update action.

    Args:
        module: The stage module, or an nn.ModuleList of the rank's stage modules.
        optimizer: Its optimizer.
        sync: Sums gradients over replicas and tied copies.
        micro_batches: M.
        warmup: The stage's warm-up w.
        options: PipeMare settings.
        hooks: Update hooks, run in this order before every optimizer step until one
            returns False (fp16's unscale, the NaN check, clipping; `graphpipe.runtime.hooks`).
    """

    name = "base"
    recomputes = False  # whether the backward re-runs the forward (PipeMare)
    versioned = False  # forwards run on versions of the weights (stash, 2bw): whole tensors
    overlaps = False  # whether gradient sums start during the last backward (flush, 2bw)

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync: GradSync,
        micro_batches: int,
        warmup: int = 0,
        options: PolicyOptions | None = None,
        hooks: Sequence[UpdateHook] = (),
    ) -> None:
        self.module, self.optimizer, self.sync, self.m = module, optimizer, sync, micro_batches
        self.warmup, self.options = warmup, options or PolicyOptions()
        self.params = dict(module.named_parameters())
        # (pass, micro-batch, updates reflected) of the last LOG micro-batches
        self.log: deque[tuple[str, int, int]] = deque(maxlen=2 * LOG)
        self.version = 0  # k: optimizer steps taken
        self.peak_copies = 1  # the most copies held at once so far
        self._names = {id(p): n for n, p in self.params.items()}  # kept by copy on write
        parts = list(module) if isinstance(module, nn.ModuleList) else [module]
        self.finals = FinalGrads(sync, parts)
        self.hooks = tuple(hooks)

    def loss_scale(self, share: float | None = None) -> float:
        """What a micro-batch's loss is multiplied by before its backward: its share of the
        mini-batch's rows (`share`, where micro-batches differ in rows), else 1 / M."""
        return 1.0 / self.m if share is None else share

    def forward(self, j: int, run: Callable[[Weights], T]) -> T:
        """Run micro-batch j's forward with the weights it should see."""
        self.log.append(("F", j, self.version))
        return run(None)

    def recompute(self, j: int, run: Callable[[Weights], T]) -> T:
        """Run micro-batch j's forward again, for its backward (PipeMare only)."""
        raise NotImplementedError(f"the {self.name} policy keeps the forward's graph")

    def backward(self, j: int, run: Callable[[], None], final: Sequence[nn.Parameter] = ()) -> None:
        """Run micro-batch j's backward (its autograd graph already holds the weights, those
        of its forward: no update comes between a flushed step's forward and backward).

        Args:
            j: The micro-batch.
            run: The backward; it accumulates into `.grad`.
            final: The parameters whose gradients are complete once `run` returns.
        """
        self.log.append(("B", j, self.version))
        with self.finals.hooked(self._pick(final, j)):
            run()

    def accumulate(self, run: Callable[[OnGrad], None], final: Sequence[nn.Parameter] = ()) -> None:
        """Run a weight half (`backward.weight_half`), which adds gradients by hand.

        Args:
            run: Called with `on_grad`, which it calls with each tensor after adding to its
                `.grad`.
            final: The parameters whose gradients are complete once `run` returns.
        """
        picked = self._pick(final, None)
        armed = {id(owner): p for p, owner in picked}

        def on_grad(t: torch.Tensor) -> None:
            if id(t) in armed:
                self.sync.ready(armed[id(t)], t)

        run(on_grad)
        self.finals.report(picked)

    def _pick(
        self, final: Sequence[nn.Parameter], j: int | None
    ) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The parameters of `final` to report now, with the tensors their gradients are in."""
        if not self.overlaps or not final:
            return []
        owners = self._grad_owners(j)
        mine = [p for p in final if id(p) in self._names]
        return self.finals.pick(mine, lambda p: owners[self._names[id(p)]])

    def _grad_owners(self, j: int | None) -> Mapping[str, torch.Tensor]:
        """By name, the tensors whose `.grad` micro-batch j's backward accumulates into."""
        return self.params

    def update(self, j: int | None) -> None:
        """The schedule's update action: sum gradients, step, clear them."""
        self._step()

    def _step(self) -> None:
        self.note_copies()
        self.finals.clear()
        self.sync()
        if not all(hook() for hook in self.hooks):  # in order, up to the first refusal
            self.optimizer.zero_grad(set_to_none=True)  # skipped on every rank (fp16 overflow)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def note_copies(self) -> None:
        """Remember the peak of `copies()`."""
        self.peak_copies = max(self.peak_copies, self.copies())

    def copies(self) -> int:
        """Copies of the weights this stage holds now, the live ones included."""
        return 1

    def state(self) -> dict[str, Any]:
        """What a resume needs besides the parameters and the optimizer state."""
        return {"version": self.version}

    def load_state(self, state: dict[str, Any]) -> None:
        """Inverse of `state`."""
        self.version = int(state["version"])


class Flush(WeightPolicy):
    """One version, gradient accumulation over the mini-batch, one step per mini-batch."""

    name = "flush"
    overlaps = True


class _Versioned(WeightPolicy):
    """Forwards run on aliases of the live weights (versions); an update first moves the live
    weights to fresh storage while a version in flight still aliases them (copy on write),
    so every version stays intact until its last backward. Under a mesh the stage stays
    whole on each dp rank (`versioned`): an alias of an FSDP2 shard would not be a version
    of the weights its forward gathers.

    The move keeps each parameter's Python object (the optimizer's state, the modules and
    the gradient sync hold it) and gives it a copy of its values (`p.data = copy`). Each
    alias counts its in-place changes on its own (`_alias`), so the optimizer's in-place
    steps on the moved parameter do not mark the versions saved by in-flight forwards as
    modified. Swapping the whole tensor object (`torch.utils.swap_tensors`) is not an option:
    it refuses a tensor something holds a weak reference to, which torch.export's fake mode
    (kept alive by the exported graph's node metadata) and torch.compile's guards do.
    """

    versioned = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.versions: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # id -> (k, alias)
        self.of_mb: dict[int, int] = {}

    def _version_id(self, j: int) -> int:
        raise NotImplementedError

    def _publish(self, vid: int) -> None:
        """Make version `vid` an alias of the live weights, unless it exists."""
        if vid not in self.versions:
            alias = {n: _alias(p) for n, p in self.params.items()}
            self.versions[vid] = (self.version, alias)

    def forward(self, j: int, run: Callable[[Weights], T]) -> T:
        vid = self._version_id(j)
        self._publish(vid)
        self.note_copies()
        self.of_mb[j] = vid
        k, alias = self.versions[vid]
        self.log.append(("F", j, k))
        return run(alias)

    def backward(self, j: int, run: Callable[[], None], final: Sequence[nn.Parameter] = ()) -> None:
        self.log.append(("B", j, self.versions[self.of_mb[j]][0]))
        with self.finals.hooked(self._pick(final, j)):
            run()

    def _grad_owners(self, j: int | None) -> Mapping[str, torch.Tensor]:
        return self.params if j is None else self.versions[self.of_mb[j]][1]  # its aliases

    def _take_grads(self, vid: int) -> dict[str, torch.Tensor | None]:
        """The gradients gathered on version `vid`, which then starts from none again."""
        _, alias = self.versions[vid]
        grads = {n: t.grad for n, t in alias.items()}
        for t in alias.values():
            t.grad = None
        return grads

    def _step_with(self, grads: dict[str, torch.Tensor | None]) -> None:
        """Step the live weights with `grads`; first copy them away from in-flight versions."""
        live = {p.data_ptr() for p in self.params.values()}
        if any(t.data_ptr() in live for _, a in self.versions.values() for t in a.values()):
            for p in self.params.values():
                p.data = p.detach().clone()  # the object stays: only its storage moves
        for n, p in self.params.items():
            p.grad = grads[n]
        self._step()

    def copies(self) -> int:
        if not self.params:
            return 1
        first = next(iter(self.params))
        stores = {self.params[first].data_ptr()}
        stores |= {a[first].data_ptr() for _, a in self.versions.values()}
        return len(stores)


def _alias(p: torch.Tensor) -> torch.Tensor:
    """A leaf tensor on p's storage (same offset, shape and strides) whose version counter
    is its own, unlike `p.detach()`'s, which shares p's: an in-place step on p once p has
    moved to a copy must not count as a change of the alias saved for a backward."""
    with torch.no_grad():
        alias = torch.empty(0, dtype=p.dtype, device=p.device)
        alias.set_(p.untyped_storage(), p.storage_offset(), p.shape, p.stride())
    return alias.requires_grad_(p.requires_grad)


class Stash(_Versioned):
    """PipeDream: every micro-batch an update; its backward uses its forward's version."""

    name = "stash"

    def loss_scale(self, share: float | None = None) -> float:
        return 1.0  # every micro-batch is an update of its own

    def _version_id(self, j: int) -> int:
        return self.version  # the newest weights

    def update(self, j: int | None) -> None:
        assert j is not None, "stash updates after each micro-batch"
        vid = self.of_mb.pop(j)
        grads = self._take_grads(vid)
        if vid not in self.of_mb.values():  # no other micro-batch in flight uses it
            del self.versions[vid]
        self._step_with(grads)


class TwoBW(_Versioned):
    """PipeDream-2BW: one version per mini-batch, one update per mini-batch, two copies."""

    name = "2bw"
    overlaps = True

    def _version_id(self, j: int) -> int:
        return j // self.m  # the mini-batch: its first forward publishes the live weights

    def update(self, j: int | None) -> None:
        assert j is not None, "2bw updates after the last micro-batch of a mini-batch"
        vid = j // self.m
        for mb in [mb for mb, v in self.of_mb.items() if v == vid]:
            del self.of_mb[mb]
        grads = self._take_grads(vid)
        del self.versions[vid]
        # mini-batch vid + 1 sees the weights from before this update, also on the last
        # stage, where this update runs before the mini-batch's first forward
        self._publish(vid + 1)
        self._step_with(grads)


class PipeMare(WeightPolicy):
    """PipeMare: no stashing; the backward recomputes with the live (corrected) weights."""

    name = "pipemare"
    recomputes = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delta = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.backward_weights: dict[int, dict[str, torch.Tensor]] = {}
        self.buffers = dict(self.module.named_buffers())

    def loss_scale(self, share: float | None = None) -> float:
        return 1.0  # every micro-batch is an update of its own

    def forward(self, j: int, run: Callable[[Weights], T]) -> T:
        self.log.append(("F", j, self.version))
        with torch.no_grad():
            return run(None)

    def recompute(self, j: int, run: Callable[[Weights], T]) -> T:
        """The forward again, on copies of the buffers, dropped after it: an in-place update
        (BatchNorm's running statistics) was made by the forward already. Every buffer is
        copied: which ones a forward updates cannot be told from their version counters
        (aten's batch norm does not bump them) nor from a forward in eval mode."""
        copies = {n: b.clone() for n, b in self.buffers.items()}
        if not (self.options.correction and self.warmup > 0):
            # the live parameters themselves: gradients land in their .grad
            return run({**self.params, **copies} if copies else None)
        estimate = {
            n: (p.detach() - self.warmup * self.delta[n]).requires_grad_(p.requires_grad)
            for n, p in self.params.items()
        }
        self.backward_weights[j] = estimate
        self.note_copies()
        return run({**estimate, **copies})

    def backward(self, j: int, run: Callable[[], None], final: Sequence[nn.Parameter] = ()) -> None:
        self.log.append(("B", j, self.version))
        run()  # one update per micro-batch: gradients are summed at the update

    def lr_factor(self) -> float:
        """1 / tau^(1 - min(k/K, 1)) with tau = max(w, 1); 1 when rescheduling is off."""
        if not self.options.lr_reschedule:
            return 1.0
        progress = min(self.version / max(self.options.warmup_updates, 1), 1.0)
        return 1.0 / max(self.warmup, 1) ** (1.0 - progress)

    def update(self, j: int | None) -> None:
        assert j is not None, "pipemare updates after each micro-batch"
        estimate = self.backward_weights.pop(j, None)
        if estimate is not None:
            for n, p in self.params.items():
                p.grad = estimate[n].grad
        before = {n: p.detach().clone() for n, p in self.params.items()}
        factor = self.lr_factor()
        rates = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * factor
        try:
            self._step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, rates, strict=True):
                g["lr"] = lr
        with torch.no_grad():
            for n, p in self.params.items():
                self.delta[n].mul_(self.options.ema).add_(p - before[n], alpha=1 - self.options.ema)

    def copies(self) -> int:
        return 1 + int(self.options.correction) + len(self.backward_weights)

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "delta": {n: d.clone() for n, d in self.delta.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        for n, d in state["delta"].items():
            self.delta[n].copy_(d)


CLASSES: dict[str, type[WeightPolicy]] = {
    "flush": Flush,
    "stash": Stash,
    "2bw": TwoBW,
    "pipemare": PipeMare,
}
if set(CLASSES) != set(POLICIES):  # the registry names every policy; each needs its class
    raise ImportError(f"weight policies {sorted(POLICIES)} but classes for {sorted(CLASSES)}")


def make_policy(
    name: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    sync: GradSync,
    micro_batches: int,
    warmup: int = 0,
    options: PolicyOptions | None = None,
    hooks: Sequence[UpdateHook] = (),
) -> WeightPolicy:
    """The policy called `name` (see `WeightPolicy` for the other arguments).

    Raises:
        ConfigError: an unknown policy, naming the known ones.
    """
    policy_spec(name)  # refuses an unknown name
    return CLASSES[name](module, optimizer, sync, micro_batches, warmup, options, hooks)
