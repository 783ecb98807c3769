"""The documentation site builds with warnings as errors, in seconds; the build fails
on what it exists to catch (a broken link or anchor, a page missing from the nav or a
nav entry without its page, an API entry whose object was renamed); the API reference
lists every public name; README.md's links resolve. How the docs work: docs/contributing.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import time
from pathlib import Path

import pytest
import yaml

try:
    import mkdocs  # noqa: F401
    import mkdocstrings  # noqa: F401
except ImportError as e:  # a failure, not a skip: make test installs the docs extra
    raise ImportError(f"the docs tests need the docs extra: pip install -e '.[docs]' (make test does): {e}") from e

from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import MkDocsException

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_mkdocs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _yml() -> dict:
    # mkdocs.yml has no custom tags; plain YAML reads it.
    return yaml.safe_load(MKDOCS_YML.read_text())


def _build(tmp_path: Path, **overrides) -> Path:
    site = tmp_path / "site"
    config = load_config(str(MKDOCS_YML), site_dir=str(site), **overrides)
    assert config.strict, "mkdocs.yml must keep strict: true (warnings are errors)"
    build(config)
    return site


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # as `make docs` runs it (mkdocstrings' extension path is relative)


def test_the_site_builds_strict_in_seconds(tmp_path, at_root):
    start = time.perf_counter()
    site = _build(tmp_path)
    seconds = time.perf_counter() - start
    api = (site / "api" / "core" / "index.html").read_text()
    assert "TPUScalingConfig" in api and "one worker per TPU device on whole slices" in api  # from the docstring
    rl = (site / "api" / "rl" / "index.html").read_text()
    assert "GRPOConfig" in rl and "GRPOLoop" in rl  # names imported on first use, resolved by the hook
    assert (site / "benchmarks" / "results" / "step_overhead.png").is_file()
    assert "doctest: +SKIP" not in api and "&gt;&gt;&gt;" in api  # examples render as code
    assert seconds < 60, f"the docs build took {seconds:.0f} s; it must take seconds"


# What the build exists to catch. Each case is a small site built with mkdocs.yml's
# settings (strict, validation, plugins, hooks) from pages written here.

def _mini_site(tmp_path: Path, pages: dict[str, str], nav: list) -> dict:
    docs = tmp_path / "docs"
    for name, text in pages.items():
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        (docs / name).write_text(text)
    return dict(docs_dir=str(docs), nav=nav, extra={})


GOOD = {"index.md": "# Home\n\nSee [the API](api.md#ray_train_tpu.checkpoint.save).\n",
        "api.md": "# API\n\n::: ray_train_tpu.checkpoint.save\n"}


def test_a_good_mini_site_builds(tmp_path, at_root):
    site = _build(tmp_path, **_mini_site(tmp_path, GOOD, ["index.md", "api.md"]))
    assert "Save every rank" in (site / "api" / "index.html").read_text()


@pytest.mark.parametrize("case, pages, nav, message", [
    ("broken link", {"index.md": "# Home\n\n[gone](elastic.md)\n"}, ["index.md", "api.md"], "elastic.md"),
    ("broken anchor", {"index.md": "# Home\n\n[save](api.md#ray_train_tpu.checkpoint.saved)\n"},
     ["index.md", "api.md"], "saved"),
    ("renamed function", {"api.md": "# API\n\n::: ray_train_tpu.checkpoint.save_checkpoint\n"},
     ["index.md", "api.md"], "ray_train_tpu.checkpoint.save_checkpoint"),
    ("page not in the nav", {"extra.md": "# Extra\n"}, ["index.md", "api.md"], "extra.md"),
    ("nav entry without its page", {}, ["index.md", "api.md", {"Serving": "serving.md"}], "serving.md"),
])
def test_the_build_fails_on(case, pages, nav, message, tmp_path, at_root, caplog):
    overrides = _mini_site(tmp_path, {**GOOD, **pages}, nav)
    with caplog.at_level(logging.WARNING), pytest.raises((MkDocsException, SystemExit)) as failed:
        _build(tmp_path, **overrides)
    said = caplog.text + str(failed.value)
    assert message in said, f"{case}: the failure does not name {message!r}: {said}"


# The API reference and the nav.

API_PAGES = sorted((DOCS / "api").glob("*.md"))
FULLY_DOCUMENTED = ["ray_train_tpu", "ray_train_tpu.checkpoint", "ray_train_tpu.strategies", "ray_train_tpu.testing"]
ALSO_DOCUMENTED = ["ray_train_tpu.data.stateful_dataloader", "ray_train_tpu.serve.build_llm_config",
                   "ray_train_tpu.serve.build_openai_app", "ray_train_tpu.rl.GRPOConfig", "ray_train_tpu.rl.GRPOLoop"]


def _api_identifiers() -> list[str]:
    return [m for page in API_PAGES for m in re.findall(r"^:::\s+([\w.]+)", page.read_text(), flags=re.M)]


def _object(path: str):
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_the_api_reference_lists_every_public_name():
    hooks = _hooks()
    identifiers = _api_identifiers()
    documented = {id(_object(hooks.resolve(i))) for i in identifiers if not i.startswith(("ray_train_tpu.rl", "ray_train_tpu.serve"))}
    missing = [f"{pkg}.{name}" for pkg in FULLY_DOCUMENTED for name in importlib.import_module(pkg).__all__
               if id(getattr(importlib.import_module(pkg), name)) not in documented]
    missing += [p for p in ALSO_DOCUMENTED if p not in identifiers and hooks.resolve(p) not in identifiers]
    assert missing == [], f"public names missing from docs/api/*.md: {missing}"


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    assert local, "README.md links into docs/"
    broken = [link for link in local if not (ROOT / link).exists()]
    assert broken == [], f"README.md links to files that do not exist: {broken}"
