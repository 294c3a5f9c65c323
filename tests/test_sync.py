"""Gradient sync: buckets summed during the last backward equal one plain sum at the update.

Two processes (gloo, one thread each) hold replicas of the same small model, each with its
own micro-batches. Every scenario runs inside one launch, to pay the start-up once; a worker
records what it saw (the gradients the optimizer was stepped with, and the order of the
all-reduces, hooks and returns, instrumented, not timed) and the tests assert on that. The
reference is the plain thing: accumulate the same micro-batches, then sum each gradient with
a synchronous all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from graphpipe.errors import PipelineError
from graphpipe.ir import Action
from graphpipe.runtime import backward, sync
from graphpipe.runtime.launch import launch
from graphpipe.runtime.sync import GradSync, SyncGroup, final_backwards, make_groups
from graphpipe.runtime.weights import make_policy

M = 3  # micro-batches per step
TIMEOUT = 120  # seconds for the launch
TINY = 1  # bucket bytes: every parameter its own bucket
EVENTS: list[str] = []  # what happened, in order, in this worker


class Chain(nn.Module):
    """Three linear layers (six parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Uneven(Chain):
    """A chain with a head used by rank 0 only and a parameter nothing uses."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 2)
        self.never = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        return y + self.extra(x) if dist.get_rank() == 0 else y


class Half(nn.Module):
    """One of two stages that hold the same tied weight."""

    def __init__(self, tied: nn.Parameter) -> None:
        super().__init__()
        self.tied = tied
        self.own = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.own(x) @ self.tied)


class Capture(torch.optim.Optimizer):
    """Records the gradients it is stepped with; changes nothing."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self.seen: list[list[torch.Tensor | None]] = []

    def step(self, closure: Any = None) -> None:
        self.seen.append(
            [None if p.grad is None else p.grad.clone() for p in self.param_groups[0]["params"]]
        )


def _data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """M micro-batches (x [2, 4], y [2, 4]), different on each rank."""
    gen = torch.Generator().manual_seed(100 * dist.get_rank() + seed)
    return [(torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(M)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y[..., : out.shape[-1]]) ** 2).sum() * (1.0 / M)


def _reference(make: Callable[[], nn.Module], data: Sequence[Any]) -> list[torch.Tensor]:
    """Accumulate the micro-batches, then sum every gradient with a plain all-reduce."""
    torch.manual_seed(0)
    model = make()
    for x, y in data:
        _loss(model(x), y).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
    return grads


def _recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        EVENTS.append("all_reduce async" if kwargs.get("async_op") else "all_reduce")
        return fn(*args, **kwargs)

    return all_reduce


def _note(what: str) -> Callable[[torch.Tensor], None]:
    return lambda _: EVENTS.append(what)


def _policy(name: str, model: nn.Module, groups: list[SyncGroup], cap: int) -> Any:
    sync = GradSync(groups, bucket_bytes=cap)
    return make_policy(name, model, Capture(list(model.parameters())), sync, M)


def _flush(group: Any, make: Callable[[], nn.Module], cap: int, at: int = M - 1) -> dict[str, Any]:
    """Flush with every parameter summed over the two replicas; `final` at micro-batch `at`
    (-1: never)."""
    data = _data(1)
    expected = _reference(make, data)
    torch.manual_seed(0)
    model = make()
    params = list(model.parameters())
    policy = _policy("flush", model, [SyncGroup((0, 1), group, params, "stage 0 replicas")], cap)
    EVENTS.clear()
    for j, (x, y) in enumerate(data):
        if j == M - 1:  # registered before the policy's: it runs first
            params[0].register_post_accumulate_grad_hook(_note("first parameter accumulated"))
        policy.backward(j, lambda x=x, y=y: _loss(model(x), y).backward(), params * (j == at))
        EVENTS.append(f"returned {j}")
    EVENTS.append("update")
    try:
        policy.update(None)
    except PipelineError as exc:
        return {"error": str(exc)}
    return {"grads": policy.optimizer.seen[-1], "expected": expected, "events": list(EVENTS)}


def _weight_half(group: Any) -> dict[str, Any]:
    """Flush with the zero-bubble split: input halves, then weight halves by hand."""
    data = _data(2)
    expected = _reference(Chain, data)
    torch.manual_seed(0)
    model = Chain()
    params = list(model.parameters())
    policy = _policy("flush", model, [SyncGroup((0, 1), group, params, "replicas")], TINY)
    halves = []
    EVENTS.clear()
    for j, (x, y) in enumerate(data):
        x = x.requires_grad_()
        loss = _loss(model(x), y)
        policy.backward(
            j,
            lambda x=x, loss=loss: halves.append(
                backward.input_half([loss], [None], [x], params)[1]
            ),
        )
    for j, half in enumerate(halves):
        policy.accumulate(
            lambda on_grad, half=half: backward.weight_half(half, on_grad), params * (j == M - 1)
        )
        EVENTS.append(f"returned {j}")
    EVENTS.append("update")
    policy.update(None)
    return {"grads": policy.optimizer.seen[-1], "expected": expected, "events": list(EVENTS)}


def _tied_twice(group: Any) -> dict[str, Any]:
    """A rank holds two stages that share a weight summed with the other rank: the weight is
    final only after the second stage's last backward, whichever stage goes first."""
    data = _data(3)
    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(4, 4))
    a, b = Half(tied), Half(tied)
    module = nn.ModuleList([a, b])
    ref = nn.Parameter(tied.detach().clone())  # reference: both stages, then one plain sum
    ref_a, ref_b = Half(ref), Half(ref)
    ref_a.own.load_state_dict(a.own.state_dict())
    ref_b.own.load_state_dict(b.own.state_dict())
    for x, y in data:
        _loss(ref_b(ref_a(x)), y).backward()
    assert ref.grad is not None
    expected = [ref.grad.clone()]
    dist.all_reduce(expected[0])
    policy = _policy("flush", module, [SyncGroup((0, 1), group, [tied], "tied w")], TINY)
    EVENTS.clear()
    for j, (x, y) in enumerate(data):  # every backward of b, then every backward of a
        h = a(x)
        cut = h.detach().requires_grad_()
        last = j == M - 1
        policy.backward(j, lambda c=cut, y=y: _loss(b(c), y).backward(), [*b.parameters()] * last)
        EVENTS.append(f"returned b{j}")
        policy.backward(j, lambda h=h, c=cut: h.backward(c.grad), [*a.parameters()] * last)
        EVENTS.append(f"returned a{j}")
    EVENTS.append("update")
    policy.update(None)
    return {"grads": [policy.optimizer.seen[-1][0]], "expected": expected, "events": list(EVENTS)}


def _two_bw(group: Any) -> dict[str, Any]:
    """2bw: backwards run on a version (aliases) of the weights; its gradients are summed."""
    data = _data(4)
    expected = _reference(Chain, data)
    torch.manual_seed(0)
    model = Chain()
    params = list(model.parameters())
    policy = _policy("2bw", model, [SyncGroup((0, 1), group, params, "replicas")], TINY)
    EVENTS.clear()
    for j, (x, y) in enumerate(data):
        out = policy.forward(
            j, lambda w, x=x: model(x) if w is None else functional_call(model, w, (x,))
        )
        policy.backward(j, lambda out=out, y=y: _loss(out, y).backward(), params * (j == M - 1))
        EVENTS.append(f"returned {j}")
    EVENTS.append("update")
    policy.update(M - 1)
    return {"grads": policy.optimizer.seen[-1], "expected": expected, "events": list(EVENTS)}


def _worker() -> dict[str, Any]:
    group = dist.new_group([0, 1])
    dist.all_reduce = _recorded(dist.all_reduce)  # this worker's own process
    return {
        "tiny": _flush(group, Chain, TINY),
        "one bucket": _flush(group, Chain, 2**20),
        "uneven": _flush(group, Uneven, TINY),
        "no final": _flush(group, Uneven, TINY, at=-1),
        "too early": _flush(group, Chain, TINY, at=0),
        "weight half": _weight_half(group),
        "tied twice": _tied_twice(group),
        "2bw": _two_bw(group),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(_worker, 2, timeout=TIMEOUT, backend="gloo", comm_timeout=30)


def _assert_sums(run: dict[str, Any]) -> None:
    assert len(run["grads"]) == len(run["expected"])
    for got, want in zip(run["grads"], run["expected"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _before(events: list[str], first: str, then: str) -> bool:
    return events.index(first) < events.index(then)


@pytest.mark.parametrize("case", ["tiny", "one bucket", "uneven", "no final", "weight half"])
def test_bucketed_sums_equal_one_plain_sum(runs: list[dict[str, Any]], case: str) -> None:
    for run in runs:
        _assert_sums(run[case])


def test_buckets_start_during_the_last_backward(runs: list[dict[str, Any]]) -> None:
    """With a bucket per parameter, the first all-reduce starts before the backward reaches
    the first layer; all six start before the last backward returns, none earlier."""
    for run in runs:
        events = run["tiny"]["events"]
        assert events.count("all_reduce async") == 6, events
        assert "all_reduce" not in events
        assert _before(events, f"returned {M - 2}", "all_reduce async")
        reached = events.index("first parameter accumulated")
        assert events[:reached].count("all_reduce async") >= 4, events  # all but the 1st layer
        assert _before(events, "all_reduce async", f"returned {M - 1}")
        assert events[-1] == "update"


def test_one_bucket_below_the_cap(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        events = run["one bucket"]["events"]
        assert events.count("all_reduce async") == 1
        assert _before(events, "all_reduce async", f"returned {M - 1}")


def test_parameters_without_a_gradient_are_summed_too(runs: list[dict[str, Any]]) -> None:
    """`extra` gets a gradient on rank 0 only and `never` nowhere: the sums hold rank 0's
    gradient and zeros; with `final`, everything is launched by the time the backward
    returns, without it everything is reduced at the update."""
    for run in runs:
        never, *_, extra_b = run["uneven"]["grads"]  # a module's own parameters come first
        assert torch.equal(never, torch.zeros(3))
        assert extra_b.abs().sum() > 0
        events = run["uneven"]["events"]
        assert events.count("all_reduce async") == 9
        assert _before(events, "all_reduce async", f"returned {M - 1}")
        assert events.index("update") > max(i for i, e in enumerate(events) if "all_reduce" in e)
        late = run["no final"]["events"]
        assert late.index("update") < late.index("all_reduce async")
        assert late.count("all_reduce async") == 9


def test_the_weight_half_reports_gradients_by_hand(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        events = run["weight half"]["events"]
        assert events.count("all_reduce async") == 6
        assert _before(events, f"returned {M - 2}", "all_reduce async")
        assert _before(events, "all_reduce async", f"returned {M - 1}")


def test_a_weight_held_by_two_stages_of_a_rank_waits_for_both(
    runs: list[dict[str, Any]],
) -> None:
    for run in runs:
        _assert_sums(run["tied twice"])
        events = run["tied twice"]["events"]
        assert events.count("all_reduce async") == 1
        assert _before(events, f"returned b{M - 1}", "all_reduce async")
        assert _before(events, "all_reduce async", f"returned a{M - 1}")


def test_2bw_sums_the_gradients_of_its_version(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        _assert_sums(run["2bw"])
        events = run["2bw"]["events"]
        assert events.count("all_reduce async") == 6
        assert _before(events, "all_reduce async", f"returned {M - 1}")


def test_a_gradient_reported_final_too_early_is_refused(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        error = run["too early"]["error"]
        assert "stage 0 replicas" in error and "[0, 1]" in error, error


def test_buckets_are_cut_in_reverse_order_at_the_cap_and_at_a_dtype_change() -> None:
    a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    c = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    sync = GradSync([SyncGroup((0, 1), object(), [a, b, c], "g")], bucket_bytes=32)
    assert [[id(p) for p in bucket.params] for bucket in sync.buckets[0]] == [
        [id(c)],
        [id(b), id(a)],
    ]
    tiny = GradSync([SyncGroup((0, 1), object(), [a, b], "g")], bucket_bytes=TINY)
    assert [len(bucket.params) for bucket in tiny.buckets[0]] == [1, 1]
    assert not GradSync([SyncGroup((0, 1), None, [a], "not mine")]).tracks(a)


@pytest.mark.parametrize(
    ("program", "finals"),
    [
        ("0F0 0F1 0B0 0B1 0U", ["0B1"]),
        ("0F0 0I0 0F1 0I1 0W0 0W1 0U", ["0W1"]),
        ("0F0 3F0 3B0 0B0 0F1 3F1 3B1 0B1 0U", ["3B1", "0B1"]),  # two stages on one rank
        ("1F0 1B0 1U0 1F1 1B1 1U1", ["1B0", "1B1"]),  # an update per micro-batch
        ("1F0 1B0 1F1", []),  # the update comes in a later call
    ],
)
def test_final_backwards_are_each_stages_last_before_an_update(
    program: str, finals: list[str]
) -> None:
    ops = [Action.parse(t) for t in program.split()]
    assert sorted(str(ops[i]) for i in final_backwards(ops)) == sorted(finals)


# -- tied weights: one process group per set of ranks ---------------------------------------


class TwoTied(nn.Module):
    """Two weights tied across the same two stages: the embedding with the output projection,
    and an input projection with an output one."""

    def __init__(self, vocab: int = 12, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj_in = nn.Linear(width, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.proj_out = nn.Linear(width, width)
        self.proj_out.weight = self.proj_in.weight
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj_in(self.embed(tokens)))  # (B, T, width)
        return self.out(self.proj_out(self.body(h))).mean(dim=1)  # (B, vocab)


TIED_PINS = {"embed": 0, "proj_in": 0, "body": 1, "proj_out": 1, "out": 1}
TIED_M, TIED_STEPS, TIED_LR = 4, 3, 0.1  # micro-batches of 2 samples


def _two_tied() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 12, (8, 5), generator=torch.Generator().manual_seed(3))
    return TwoTied(), tokens


def _tied_target(step: int) -> torch.Tensor:
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(50 + step))


def _tied_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: the same micro-batches accumulated, then one SGD step, per step."""
    model, tokens = _two_tied()
    opt = torch.optim.SGD(model.parameters(), lr=TIED_LR)
    losses = []
    for step in range(TIED_STEPS):
        target, total = _tied_target(step), 0.0
        for x, y in zip(tokens.chunk(TIED_M), target.chunk(TIED_M), strict=True):
            loss = nn.functional.mse_loss(model(x), y)
            (loss / TIED_M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / TIED_M)
    return losses, model.state_dict()


def _tied_worker() -> dict[str, Any]:
    from graphpipe.compile import RuntimeConfig
    from graphpipe.compile import compile as gp_compile
    from graphpipe.planning.partition import plan
    from graphpipe.runtime import groups as wiring_groups

    made: list[list[Any]] = []
    syncs: list[GradSync] = []

    def recording_groups(*args: Any, **kwargs: Any) -> list[Any]:
        made.append(make_groups(*args, **kwargs))
        return made[-1]

    def recording_sync(*args: Any, **kwargs: Any) -> GradSync:
        syncs.append(GradSync(*args, **kwargs))
        return syncs[-1]

    wiring_groups.make_groups = recording_groups  # type: ignore[assignment]  # this worker only
    wiring_groups.GradSync = recording_sync  # type: ignore[assignment,misc]
    model, tokens = _two_tied()
    pm = gp_compile(
        model,
        (tokens,),
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=TIED_LR),
        plan=plan(model, (tokens,), devices=2, micro_batches=TIED_M, pins=TIED_PINS),
        runtime=RuntimeConfig(timeout=60),
    )
    losses = [pm.step(tokens, target=_tied_target(step)) for step in range(TIED_STEPS)]
    (groups,) = made
    (sync,) = syncs
    return {
        "groups": len(groups),
        "distinct": len({id(g) for g in groups if g is not None}),
        "synced": [(g.ranks, g.label, len(g.params)) for g in sync.groups],
        "losses": losses,
        "state": pm.state_dict(),
    }


@pytest.fixture(scope="module")
def tied_runs() -> list[dict[str, Any]]:
    return launch(_tied_worker, 2, timeout=TIMEOUT, backend="gloo", comm_timeout=30)


def test_weights_tied_across_the_same_ranks_share_one_group(
    tied_runs: list[dict[str, Any]],
) -> None:
    for run in tied_runs:
        assert (run["groups"], run["distinct"]) == (2, 1), run  # two tied weights, one group
        assert run["synced"] == [((0, 1), "tied embed.weight, tied proj_in.weight", 2)], run


def test_two_tied_weights_train_as_one_process(tied_runs: list[dict[str, Any]]) -> None:
    losses, state = _tied_reference()
    for run in tied_runs:
        assert run["losses"] == pytest.approx(losses, rel=1e-5)
        assert list(run["state"]) == list(state)
        for key, value in state.items():
            torch.testing.assert_close(run["state"][key], value, rtol=1e-5, atol=1e-6)


def test_make_groups_makes_one_group_per_set_of_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout: made.append(ranks) or object())
    monkeypatch.setattr(sync, "guarded", lambda what, call: call())  # no process group here
    memberships = [((0, 1), "stage 0 replicas"), ((1, 0), "tied a"), ((1, 2), "tied b")]
    groups = make_groups(memberships, 1, 30.0)
    assert made == [[0, 1], [1, 2]]
    assert groups[0] is groups[1] and groups[0] is not groups[2]
    assert make_groups(memberships, 2, 30.0)[:2] == [None, None]
