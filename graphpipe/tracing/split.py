"""How each input of a call splits into micro-batches: by its batch dimension, whole, or by
a function of the whole batch.

    split = InputSplit({"position_ids": 1, "image_grid": "replicate", "pixel_values": by_grid})
    batch = split.batch(named)              # B: the size of every batch dimension
    pieces = split.pieces(named, n)         # each input cut into n pieces, piece j per input

Most inputs carry the batch on dim 0, and that is the default. Others do not: Qwen2-VL's
`pixel_values` rows are patches (`image_grid_thw` says how many each image has), mrope's
`position_ids` are (3, B, L), a packed batch's `cu_seqlens` are offsets. A rule per input
says how it splits, as torch.distributed.pipelining's chunk specs do:

- an int d: the batch is dim d (`torch.tensor_split` along it, as for dim 0);
- "replicate": every micro-batch gets the whole tensor;
- a function `fn(x, inputs, n) -> n tensors`: x cut into n pieces, piece j going with the
  j-th n-th of the batch; `inputs` maps every tensor input of the call (keyword name, or
  positional index) to its whole value, so patch rows can follow their grid:

      def by_grid(x, inputs, n):
          rows = inputs["image_grid_thw"].prod(-1)            # patch rows per image
          return x.split([int(r.sum()) for r in rows.tensor_split(n)])

- `Static(rule)` (or "static", for `Static(0)`): split by `rule`, and its values are
  constants of the trace. For small integer inputs the model reads back to the host to make
  shapes (Qwen2-VL's `image_grid_thw`, whose `.tolist()` sizes its vision attention's
  blocks): the trace folds what is computed from them into literals, so no stage holds a
  shape that depends on values. Every micro-batch must then carry the values the trace saw
  (fixed-size images), which the runtime checks on every step, refusing another by name.
  Keyword inputs of a torch.export trace only.

The inputs split by a dimension set the batch B, and must agree on it; at least one must.
Where no rule is given and an input's dim 0 is not the batch, the rule is inferred when
exactly one of its dimensions has the batch's size (the batch being the dim-0 size most
inputs share), and refused by name otherwise, naming the rule to give. With dp slices, a
function is asked for M * dp pieces (slice d of micro-batch j is piece j * dp + d), as
`tensor_split` into M and then into dp is for a batch dimension that M * dp divides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphpipe.errors import ConfigError
from graphpipe.tracing.annotate import Source  # a positional index or a keyword name

__all__ = ["REPLICATE", "STATIC", "InputSplit", "Rule", "SplitFn", "Static"]

SplitFn = Callable[[torch.Tensor, Mapping[Source, torch.Tensor], int], Sequence[torch.Tensor]]
REPLICATE = "replicate"
STATIC = "static"  # Static(0), as the CLI's JSON writes it


@dataclass(frozen=True)
class Static:
    """An input split by `rule` whose values are constants of the trace (module docstring).

    Args:
        rule: How it splits: a dim, "replicate" or a function, as any input's rule.
    """

    rule: int | str | SplitFn = 0

    def __repr__(self) -> str:
        return f"Static({_rule_text(self.rule)})"


Rule = int | str | SplitFn | Static


class InputSplit:
    """Each input's split rule; inputs not named split on dim 0 (or an inferred dim).

    Args:
        rules: Input (keyword name, or positional index) -> an int dim, "replicate" or a
            function (module docstring). None: every input on dim 0.

    Raises:
        ConfigError: a rule of another kind, naming the input and the rule.
    """

    def __init__(
        self,
        rules: Mapping[Source, Rule] | None = None,
        inferred: Mapping[Source, int] | None = None,
    ) -> None:
        given = {s: Static() if r == STATIC else r for s, r in (rules or {}).items()}
        self.rules: dict[Source, Rule] = given
        self.inferred: dict[Source, int] = dict(inferred or {})  # by `resolved`
        bad = [
            f"{name!r}: {rule!r}" for name, rule in self.rules.items() if not _valid(_plain(rule))
        ]
        if bad:
            raise ConfigError(
                "input_split takes, per input, a dim (int), 'replicate', a function "
                "fn(x, inputs, n) returning n tensors, or Static(one of these) ('static')",
                bad,
            )

    @property
    def static(self) -> frozenset[Source]:
        """The inputs whose values are constants of the trace (`Static`)."""
        return frozenset(s for s, r in self.rules.items() if isinstance(r, Static))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputSplit):
            return NotImplemented
        return (self.rules, self.inferred) == (other.rules, other.inferred)

    __hash__ = None  # type: ignore[assignment]  # its rules are a dict

    def __bool__(self) -> bool:
        return bool(self.rules or self.inferred)

    def __repr__(self) -> str:
        return f"InputSplit({self.describe()})"

    def describe(self) -> str:
        """The rules in one line: `pixel_values by by_grid, position_ids dim 1 (inferred)`."""
        parts = [f"{_label(s)} {_rule_text(r)}" for s, r in self.rules.items()]
        parts += [f"{_label(s)} dim {d} (inferred)" for s, d in self.inferred.items()]
        return ", ".join(parts) or "every input on dim 0"

    def dim(self, source: Source) -> int | None:
        """The batch dim of `source`, None where it is replicated or split by a function."""
        rule = _plain(self.rules.get(source, self.inferred.get(source, 0)))
        return rule if _is_dim(rule) else None

    def batch(self, named: Mapping[Source, torch.Tensor]) -> int:
        """B, which every input split by a dimension carries.

        Raises:
            ConfigError: no input carries the batch, a dim beyond an input's dimensions, or
                inputs that disagree on B, naming them and the rule to give.
        """
        sizes: dict[Source, int] = {}
        for source, x in named.items():
            d = self.dim(source)
            if d is None:
                continue
            if x.dim() <= d:
                raise ConfigError(
                    f"input {_label(source)} is {list(x.shape)}: it has no dim {d} to carry the "
                    "batch; give its rule in input_split (a dim, 'replicate' or a function)"
                )
            sizes[source] = int(x.shape[d])
        if not sizes:
            raise ConfigError(
                "no input carries the batch: input_split replicates or splits by a function "
                f"every input ({self.describe()}); at least one must be split by a dimension"
            )
        if len(set(sizes.values())) > 1:
            shown = {_label(s): n for s, n in sizes.items()}
            raise ConfigError(
                f"the inputs' batch dimensions differ: {shown} (rules: {self.describe()}); "
                "give input_split a rule for each input that does not carry the batch "
                "(a dim, 'replicate' or a function of the whole batch)"
            )
        return next(iter(sizes.values()))

    def resolved(self, named: Mapping[Source, torch.Tensor]) -> InputSplit:
        """These rules, and for each input named by none whose dim 0 is not the batch, the
        one dim of the batch's size. The batch: a dim rule's, else the dim-0 size of some
        input that every other input has on dim 0 or on exactly one dim (the most common
        such size where several qualify). Made once, from the example; every later call
        splits by it.

        Raises:
            ConfigError: a scalar input, or an input whose batch dim cannot be told, naming
                it and its shape.
        """
        free = {s: x for s, x in named.items() if s not in self.rules and s not in self.inferred}
        scalars = [_label(s) for s, x in free.items() if x.dim() == 0]
        if scalars:
            raise ConfigError(
                f"inputs {scalars} are scalars; give them the rule 'replicate' in input_split, "
                "or a batch dimension"
            )
        if not free:
            return InputSplit(self.rules, self.inferred)
        given = self._given_batch(named)
        counts = Counter(int(x.shape[0]) for x in free.values()).most_common()
        fits = [(b, n) for b, n in counts if given in (None, b) and _dims(free, b) is not None]
        if not fits or (len(fits) > 1 and fits[0][1] == fits[1][1]):
            batch = given or counts[0][0]
            bad = _misplaced(free, batch) if not fits else ""
            raise ConfigError(
                "the inputs' dim 0 differ "
                + (bad or f"and several sizes could be the batch ({[b for b, _ in fits]})")
                + f": { {_label(s): list(x.shape) for s, x in free.items()} }; give input_split "
                "a rule for each input whose dim 0 is not the batch (a dim, 'replicate', or a "
                "function fn(x, inputs, n) that cuts the whole batch's value into n pieces)"
            )
        found = _dims(free, fits[0][0])
        assert found is not None
        return InputSplit(self.rules, {**self.inferred, **found})

    def _given_batch(self, named: Mapping[Source, torch.Tensor]) -> int | None:
        for source, given in self.rules.items():
            rule = _plain(given)
            if _is_dim(rule) and source in named and named[source].dim() > rule:
                return int(named[source].shape[rule])
        return None

    def pieces(self, named: Mapping[Source, torch.Tensor], n: int) -> dict[Source, list[Any]]:
        """Every input cut into `n` pieces (a replicated one repeated).

        Raises:
            ConfigError: a function that does not return `n` tensors of the input's dtype
                and number of dimensions, naming the input.
        """
        return {source: self._cut(source, x, named, n) for source, x in named.items()}

    def _cut(
        self, source: Source, x: torch.Tensor, named: Mapping[Source, torch.Tensor], n: int
    ) -> list[torch.Tensor]:
        rule = _plain(self.rules.get(source, self.inferred.get(source, 0)))
        if _is_dim(rule):
            return list(x.tensor_split(n, dim=rule))
        if rule == REPLICATE:
            return [x] * n
        assert callable(rule)
        out = list(rule(x, named, n))
        bad = [
            f"piece {j} is {type(p).__name__}"
            if not isinstance(p, torch.Tensor)
            else f"piece {j} is {p.dtype}{list(p.shape)}"
            for j, p in enumerate(out)
            if not isinstance(p, torch.Tensor) or p.dtype != x.dtype or p.dim() != x.dim()
        ]
        if len(out) != n or bad:
            raise ConfigError(
                f"input_split's function for {_label(source)} ({_rule_text(rule)}) returned "
                f"{len(out)} pieces of {x.dtype}{list(x.shape)} for n={n}; it must return n "
                f"tensors of its dtype and number of dimensions{': ' if bad else ''}"
                + "; ".join(bad[:3])
            )
        return out

    def micro_batches(
        self,
        source: Source,
        named: Mapping[Source, torch.Tensor],
        m: int,
        dp: int = 1,
        index: int = 0,
    ) -> list[torch.Tensor]:
        """Input `source`'s M micro-batches, each its dp slice `index` (views where the rule
        cuts along a dimension): along its batch dim, `tensor_split` into M and each into
        dp; a function's M * dp pieces, slice d of micro-batch j being piece j * dp + d.

        Raises:
            ConfigError: as `pieces`.
        """
        x = named[source]
        d = self.dim(source)
        if d is not None:
            chunks = x.tensor_split(m, dim=d)
            return list(chunks) if dp == 1 else [c.tensor_split(dp, dim=d)[index] for c in chunks]
        pieces = self._cut(source, x, named, m * dp)
        return [pieces[j * dp + index] for j in range(m)]

    def first(self, named: Mapping[Source, torch.Tensor], n: int) -> dict[Source, torch.Tensor]:
        """Piece 0 of every input cut into `n` pieces: the micro-batch a trace runs at."""
        return {source: pieces[0] for source, pieces in self.pieces(named, n).items()}


def _dims(free: Mapping[Source, torch.Tensor], batch: int) -> dict[Source, int] | None:
    """The batch dim of each input whose dim 0 is not `batch`: its one dim of that size;
    None where some input has none, or several (`_misplaced`)."""
    found = {s: _sized(x, batch) for s, x in free.items() if x.shape[0] != batch}
    if any(len(dims) != 1 for dims in found.values()):
        return None
    return {s: dims[0] for s, dims in found.items()}


def _misplaced(free: Mapping[Source, torch.Tensor], batch: int) -> str:
    """The first input without a single dim of the batch's size, as the refusal says it."""
    for source, x in free.items():
        dims = _sized(x, batch)
        if x.shape[0] != batch and len(dims) != 1:
            what = "no" if not dims else "more than one"
            return (
                f"(input {_label(source)} is {list(x.shape)}: its dim 0 is not the batch of "
                f"{batch} and {what} other dimension is)"
            )
    return ""


def _sized(x: torch.Tensor, batch: int) -> list[int]:
    """The dims of `x` that have the batch's size."""
    return [d for d, n in enumerate(x.shape) if n == batch]


def _plain(rule: Rule) -> Any:
    """The split rule itself, a `Static`'s unwrapped."""
    return rule.rule if isinstance(rule, Static) else rule


def _valid(rule: Any) -> bool:
    return _is_dim(rule) or rule == REPLICATE or callable(rule)


def _is_dim(rule: Any) -> bool:
    return isinstance(rule, int) and not isinstance(rule, bool) and rule >= 0


def _label(source: Source) -> str:
    return f"#{source}" if isinstance(source, int) else source


def _rule_text(rule: Rule) -> str:
    if isinstance(rule, Static):
        return f"{_rule_text(rule.rule)}, static"
    if _is_dim(rule):
        return f"dim {rule}"
    if rule == REPLICATE:
        return "replicated"
    return f"by {getattr(rule, '__qualname__', repr(rule))}"
