"""The Python examples of README.md and docs/, and how the suite runs each of them.

Every fenced ```python block of README.md and of every page under docs/ runs in
the suite, so that an example cannot rot. A block is run according to the HTML
comment on the line just before its fence (blank lines between are allowed):

- no comment: run by tests/unit/test_docs_examples.py, in-process, without a
  Ray cluster, in a temporary working directory. It must take seconds.
- ``<!-- run: simulated slice -->``: run by
  tests/distributed/test_docs_examples_on_slice.py. Its own
  ``simulated_tpu_cluster(...)`` calls get a cluster of the test's, started once
  for every block that asks for the same arguments, and kept up between blocks.
- ``<!-- run by: tests/distributed/test_x.py -->``: another test runs the block
  as written; that file must exist and name this page.
- ``<!-- not run: <why> -->``: not run (a real TPU, GKE, a model that is not
  here); the reason is required, and says where the behaviour is tested if it is.

Any other comment right before a Python block is an error (a misspelt marker
would otherwise quietly change how the block runs), and so is a ``>>>`` prompt.
The blocks of a page share one namespace and run in page order, as a reader
would run them: a block may use what an earlier block defined. A block that
uses what a simulated-slice block made must be marked the same way. Other
languages (bash, yaml, text) are not run.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

LOCAL, SLICE, ELSEWHERE, NOT_RUN = "local", "simulated slice", "run by", "not run"
_PYTHON = {"python", "py", "python3"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")


class MarkerError(ValueError):
    """A Python block whose marker (or content) the runner cannot accept."""


@dataclasses.dataclass(frozen=True)
class Example:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    kind: str  # LOCAL, SLICE, ELSEWHERE or NOT_RUN
    note: str = ""  # the reason (NOT_RUN) or the test file (ELSEWHERE)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def compiled(self):
        """The code, compiled so that tracebacks name the page and its line numbers."""
        return compile("\n" * self.line + self.code, self.page, "exec")


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/ (not the site's tooling)."""
    found = sorted(p for p in DOCS.rglob("*.md") if "_mkdocs" not in p.relative_to(DOCS).parts)
    return [ROOT / "README.md", *found]


def rel(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


def parse_marker(text: str, where: str) -> tuple[str, str]:
    """(kind, note) of a comment's body."""
    body = " ".join(text.split())
    head, sep, rest = body.partition(":")
    head, rest = head.strip().lower(), rest.strip()
    if sep and head == "not run" and rest:
        return NOT_RUN, rest
    if sep and head == "run" and rest.lower() == SLICE:
        return SLICE, ""
    if sep and head == "run by" and rest:
        return ELSEWHERE, rest
    raise MarkerError(
        f"{where}: the comment <!--{text}--> right before a Python block is not a marker; use "
        "<!-- run: simulated slice -->, <!-- run by: tests/...py --> or <!-- not run: <why> -->, "
        "or put a blank paragraph between them (see tests/docs_examples.py)"
    )


def examples(text: str, page: str) -> list[Example]:
    """The Python blocks of one page, in order, each with how it is run."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence) and not lines[j].strip().strip(fence[0])), len(lines))
        if m["info"].lower() in _PYTHON:
            code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            found.append(_example(lines, i, code, page))
        i = end + 1
    return found


def _example(lines: list[str], fence_index: int, code: str, page: str) -> Example:
    where = f"{page}:{fence_index + 1}"
    if re.search(r"^\s*>>>", code, flags=re.M):
        raise MarkerError(f"{where}: write the example as plain Python, without >>> prompts")
    before = next((line for line in reversed(lines[:fence_index]) if line.strip()), "")
    comment = _COMMENT.match(before)
    kind, note = parse_marker(comment["body"], where) if comment else (LOCAL, "")
    return Example(page=page, line=fence_index + 1, code=code, kind=kind, note=note)


def all_examples() -> list[Example]:
    return [ex for path in pages() for ex in examples(path.read_text(), rel(path))]


def by_page(found: Iterable[Example]) -> dict[str, list[Example]]:
    out: dict[str, list[Example]] = {}
    for ex in found:
        out.setdefault(ex.page, []).append(ex)
    return out


def namespace(page: str) -> dict:
    """A fresh namespace for a page's blocks. Its module name is importable
    nowhere, so that Ray pickles the functions and classes a block defines by
    value, as it does a script's."""
    return {"__name__": "docs_example_" + re.sub(r"\W", "_", page), "__builtins__": __builtins__}


def run(blocks: Iterable[Example], ns: dict) -> list[str]:
    """Run `blocks` in order in `ns`; the places of those that ran."""
    ran = []
    for ex in blocks:
        try:
            exec(ex.compiled(), ns)
        except Exception as e:
            raise AssertionError(f"the example at {ex.where} failed: {type(e).__name__}: {e}") from e
        ran.append(ex.where)
    return ran
