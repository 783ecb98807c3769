"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

- Public names that a package imports on first use (``_PUBLIC`` / ``_LAZY`` in
  its ``__init__.py``, so that ``import ray_train_tpu`` stays cheap) are invisible
  to a static reader. An API page writes the name users import,
  ``::: ray_train_tpu.rl.GRPOConfig``, and this hook points mkdocstrings at the
  module that defines it, read from that map: a page survives a move of the
  definition, and a name that is neither defined nor mapped still fails the build.
- The benchmark plots (``benchmarks/results/*.png``) are published as
  ``benchmarks/results/<name>.png`` of the site. A page links them by their path
  in the repository (``../benchmarks/results/x.png`` from docs/), which also works
  when the Markdown is read on its own; the hook points such links at the copy.
"""

from __future__ import annotations

import ast
import functools
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "ray_train_tpu"
RESULTS = Path("benchmarks") / "results"
_DIRECTIVE = re.compile(r"^(:::[ \t]+)([\w.]+)", flags=re.M)
_LINK = re.compile(r"(\]\()([^)\s]+)")


@functools.lru_cache(maxsize=None)
def lazy_exports(package: str) -> dict[str, str]:
    """``{name: defining module}`` from the ``_PUBLIC`` / ``_LAZY`` dict of a
    package's ``__init__.py`` (read, not imported)."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return {}
    found: dict[str, str] = {}
    for node in ast.parse(init.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id in ("_PUBLIC", "_LAZY") for t in node.targets)):
            found.update(ast.literal_eval(node.value))
    return found


def resolve(identifier: str) -> str:
    """The path mkdocstrings should collect for a public `identifier`."""
    package, _, name = identifier.rpartition(".")
    if package.split(".")[0] == PACKAGE and name in lazy_exports(package):
        return f"{lazy_exports(package)[name]}.{name}"
    return identifier


def published(target: str, page_uri: str) -> str:
    """A link from a page (``page_uri`` inside docs/) to a file of the repository
    that the site publishes, made relative to the page in the site; else unchanged."""
    if re.match(r"[a-z]+:|#|/", target):
        return target
    in_repo = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))
    if not in_repo.startswith(RESULTS.as_posix() + "/"):
        return target
    return posixpath.relpath(in_repo, posixpath.dirname(page_uri) or ".")


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _DIRECTIVE.sub(lambda m: m.group(1) + resolve(m.group(2)), markdown)
    return _LINK.sub(lambda m: m.group(1) + published(m.group(2), page.file.src_uri), markdown)


def on_files(files, config):
    for png in sorted((ROOT / RESULTS).glob("*.png")):
        files.append(File.generated(config, (RESULTS / png.name).as_posix(), abs_src_path=str(png)))
    return files
