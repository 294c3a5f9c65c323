"""Every Python snippet in README.md and docs/*.md runs, and every relative link resolves.

The convention the documents follow (`snippets` reads it):

- Each ```python block is a program of its own, run with the repository root on sys.path and
  a fresh temporary directory as the working directory (files a snippet writes land there).
- A block right after the HTML comment `<!-- continues: previous -->` is the rest of the
  block before it in the same file: the two run as one program, and the first never alone.
- A program that calls `graphpipe.launch(` is a script for several processes: its functions
  are at module level and its last part, `if __name__ == "__main__":`, launches them. The
  test imports it as a module (so that a worker can unpickle `main` by name), then runs that
  last part in the module's namespace, with launch's `timeout` at most `TIMEOUT` (a hung rank
  is stopped, and launch raises). The README's quickstart is run as written instead, `python
  train.py` in a subprocess (the fork server, the torchrun-or-launch line), and only so.
- Any other program runs as a script of its own, `python snippet.py` in a subprocess, killed
  when it runs past its time.
- A ```text block right after `<!-- output: previous -->` is what the program before it
  prints: each of its lines appears in the program's output, in order. After
  `<!-- output: graphpipe ARGS -->` it is what that command prints (stdout and stderr), run
  from the repository root. A quoted output is therefore one the code printed.

Docs examples are short (2 to 5 steps, tiny sizes): the file's time goes mostly to starting
interpreters and tracing (2.5 min measured on 2 cores shared with four other test runs, load
10 to 19). docs/ARCHITECTURE.md holds no Python block; its links are checked.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import graphpipe

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTINUES = "<!-- continues: previous -->"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
OUTPUT = re.compile(r"^<!-- output: (.*?) -->\n```text\n(.*?)^```", re.M | re.S)
GUARD = 'if __name__ == "__main__":\n'
LINK = re.compile(r"\]\(([^)\s]+)\)")
TIMEOUT = 180.0  # seconds a program may take on a loaded machine (each takes a few)


@dataclass(frozen=True)
class Snippet:
    """One program: a block, or blocks joined by `continues: previous`."""

    doc: str  # the file, relative to the root
    line: int  # of the first block's fence
    code: str
    output: str = ""  # what it prints, as quoted (`<!-- output: previous -->`)

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def launches(self) -> bool:
        """Whether it is a script for several processes (see the module docstring)."""
        if "graphpipe.launch(" not in self.code:
            return False
        assert GUARD in self.code, f"{self.name} launches outside `{GUARD.strip()}`"
        return True


def snippets(path: Path) -> list[Snippet]:
    """The programs of one document, in order."""
    text = path.read_text()
    out: list[Snippet] = []
    for found in FENCE.finditer(text):
        before = text[: found.start()].rstrip()
        line = text.count("\n", 0, found.start()) + 1
        if before.endswith(CONTINUES):
            assert out, f"{path.name}:{line} continues no earlier block"
            prev = out.pop()
            out.append(Snippet(prev.doc, prev.line, prev.code + found.group(1)))
        else:
            out.append(Snippet(str(path.relative_to(ROOT)), line, found.group(1)))
    for found in OUTPUT.finditer(text):
        if found.group(1) != "previous":
            continue
        at = max(i for i, s in enumerate(out) if _offset(text, s.line) < found.start())
        out[at] = Snippet(out[at].doc, out[at].line, out[at].code, found.group(2))
    return out


def _offset(text: str, line: int) -> int:
    """Where line `line` (from 1) of `text` begins."""
    return sum(len(x) + 1 for x in text.split("\n")[: line - 1])


def quoted_commands() -> list[tuple[str, str, str]]:
    """(where, the command's arguments, its quoted output) of every `<!-- output:
    graphpipe ... -->` block."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in OUTPUT.finditer(text):
            if m.group(1).startswith("graphpipe "):
                where = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                found.append((where, m.group(1).removeprefix("graphpipe "), m.group(2)))
    return found


def assert_printed(quoted: str, printed: str, where: str) -> None:
    """Each line of `quoted` appears in `printed`, in order."""
    at = 0
    for line in filter(None, (x.rstrip() for x in quoted.splitlines())):
        found = printed.find(line, at)
        assert found >= 0, f"{where}: quoted {line!r}, which the code did not print:\n{printed}"
        at = found + len(line)


QUICKSTART = snippets(ROOT / "README.md")[0]  # run as a script only: see the last test
ALL = [s for doc in DOCS for s in snippets(doc) if s != QUICKSTART]


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in `cwd`, as a user runs it (the repository importable, one thread, not
    under torchrun), its output captured, killed past TIMEOUT."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )


def _run_alone(snippet: Snippet, cwd: Path) -> None:
    path = cwd / "snippet.py"
    path.write_text(snippet.code)
    done = _python([path.name], cwd)
    assert done.returncode == 0, f"{snippet.name} failed:\n{done.stderr[-3000:]}"
    assert_printed(snippet.output, done.stdout, snippet.name)


def _run_launched(snippet: Snippet, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not snippet.output, f"{snippet.name}: a launched program's output is not captured"
    module_name = "docs_snippet_" + re.sub(r"\W", "_", snippet.name)
    path = cwd / f"{module_name}.py"
    path.write_text(snippet.code)
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))  # workers import the module by this path too
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun
    launch = graphpipe.launch

    def bounded(*args: Any, timeout: float = TIMEOUT, **kwargs: Any) -> list[Any]:
        return launch(*args, timeout=min(timeout, TIMEOUT), **kwargs)

    monkeypatch.setattr(graphpipe, "launch", bounded)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    last_part = textwrap.dedent(snippet.code.split(GUARD, 1)[1])
    exec(compile(last_part, f"{snippet.name} ({GUARD.strip()})", "exec"), vars(module))


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_runs(snippet: Snippet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if snippet.launches:
        _run_launched(snippet, tmp_path, monkeypatch)
    else:
        _run_alone(snippet, tmp_path)


@pytest.mark.parametrize("where,args,quoted", quoted_commands(), ids=lambda x: str(x)[:40])
def test_quoted_command_output_is_what_it_prints(where: str, args: str, quoted: str) -> None:
    done = _python(["-m", "graphpipe.tools.cli", *shlex.split(args)], ROOT)
    assert done.returncode == 0, f"{where}: {args} failed:\n{done.stderr[-3000:]}"
    assert_printed(quoted, done.stdout + done.stderr, where)


def test_the_quickstart_runs_as_a_script(tmp_path: Path) -> None:
    """README's train.py, saved and run with `python train.py` (its own 2 processes)."""
    assert QUICKSTART.code.startswith("# train.py")
    (tmp_path / "train.py").write_text(QUICKSTART.code)
    done = _python(["train.py"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    readme = (ROOT / "README.md").read_text()
    quoted = re.findall(r"`(step \d: loss \d+\.\d+)`", readme)  # the losses the README quotes
    assert len(quoted) == 2, quoted
    assert_printed("\n".join(quoted), done.stdout, "README.md")
    assert "graphpipe.compile: " in done.stderr  # rank 0's line of what compile chose


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_relative_links_resolve(doc: Path) -> None:
    missing = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor
        if not (doc.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_every_guide_is_in_the_readme_index() -> None:
    readme = (ROOT / "README.md").read_text()
    guides = [d.name for d in DOCS[1:]]
    assert [g for g in guides if f"(docs/{g})" not in readme] == []
