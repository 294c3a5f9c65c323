"""The import layers (graphpipe.tools.deps): no upward import, no cycle, no private torch name
outside the adapter, and the check bites."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphpipe.tools.deps import LAYERS, check, layer_of


def test_graphpipe_has_no_upward_import_and_no_cycle():
    problems = check()
    assert problems == [], "\n".join(map(str, problems))


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "graphpipe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "graphpipe"


def test_an_upward_import_is_named_with_its_line(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "ir/__init__.py": "",
            "ir/plan.py": "import json\n\ndef f():\n    from graphpipe.runtime.pipeline import X\n",
            "runtime/__init__.py": "",
            "runtime/pipeline.py": "from graphpipe.ir.plan import f\n",
        },
    )
    problems = check(pkg)
    assert [(p.kind, p.modules) for p in problems] == [
        ("upward", ("graphpipe.ir.plan", "graphpipe.runtime.pipeline")),
        ("cycle", ("graphpipe.ir.plan", "graphpipe.runtime.pipeline")),
    ]
    assert "line 4" in str(problems[0])


def test_a_cycle_within_one_layer_and_a_relative_import(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "runtime/__init__.py": "",
            "runtime/a.py": "from . import b\n",
            "runtime/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from graphpipe.runtime.a import A\n",
        },
    )
    problems = check(pkg)
    assert [p.kind for p in problems] == ["cycle"]
    assert set(problems[0].modules) == {"graphpipe.runtime.a", "graphpipe.runtime.b"}


def test_a_private_torch_name_outside_the_adapter_is_named(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_torch.py": "import torch\nfrom torch._C import _autograd\n",  # the adapter may
            "runtime/__init__.py": "",
            "runtime/a.py": "import torch\n\ndef f():\n    return torch._C._autograd._x()\n",
            "runtime/b.py": "from torch.utils._pytree import tree_map\n",  # the adapter's
            "runtime/c.py": "import torch\nop = torch.ops.aten._assert_async.msg\n"
            "from graphpipe._torch import tree_map_only\nv = torch.__version__\n",
        },
    )
    problems = check(pkg)
    assert [(p.kind, p.modules) for p in problems] == [
        ("private", ("graphpipe.runtime.a", "torch._C._autograd._x")),
        ("private", ("graphpipe.runtime.b", "torch.utils._pytree.tree_map")),
    ]
    assert "line 4" in str(problems[0]) and "graphpipe/_torch.py" in str(problems[0])


def test_layers_by_longest_prefix():
    names = [name for name, _ in LAYERS]
    assert layer_of("graphpipe.errors") == names.index("core")
    assert layer_of("graphpipe.scheduling.simulate") == names.index("scheduling")
    assert layer_of("graphpipe") == names.index("graphpipe")
    with pytest.raises(ValueError, match="torch"):
        layer_of("torch")
