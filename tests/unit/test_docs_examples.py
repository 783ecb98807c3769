"""Every Python example of README.md and docs/ that needs no cluster runs, and every
other one is marked (how: tests/docs_examples.py; the markers: docs/contributing.md).

The blocks marked ``<!-- run: simulated slice -->`` run in
tests/distributed/test_docs_examples_on_slice.py.
"""

import pytest

from tests import docs_examples as D


def _pages_with(kind):
    return sorted(page for page, found in D.by_page(D.all_examples()).items() if any(e.kind == kind for e in found))


def test_every_python_block_is_run_or_says_why_not():
    found = D.all_examples()  # raises MarkerError on a bad marker or a >>> prompt
    assert {e.page for e in found} >= {"README.md", "docs/training.md", "docs/checkpoints.md"}
    for ex in found:
        if ex.kind == D.ELSEWHERE:
            target = D.ROOT / ex.note
            assert target.is_file(), f"{ex.where}: <!-- run by: {ex.note} --> names no file"
            assert ex.page.rsplit("/", 1)[-1] in target.read_text(), (
                f"{ex.where}: {ex.note} does not mention {ex.page}, so it does not run this page's examples")


@pytest.fixture
def no_cluster(monkeypatch, tmp_path):
    """A block without a marker must not start Ray: it would need the simulation lock."""
    import ray

    import ray_train_tpu.testing
    import ray_train_tpu.testing.simulated_cluster as sc

    def refuse(*args, **kwargs):
        raise RuntimeError("this example starts a Ray cluster: mark it <!-- run: simulated slice -->")

    for module, name in ((ray_train_tpu.testing, "simulated_tpu_cluster"), (sc, "simulated_tpu_cluster"),
                         (ray, "init")):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("page", _pages_with(D.LOCAL))
def test_examples_without_a_cluster_run(page, no_cluster):
    found = D.by_page(D.all_examples())[page]
    local = [e for e in found if e.kind == D.LOCAL]
    ran = D.run(local, D.namespace(page))
    assert ran == [e.where for e in local]


# The runner itself: a broken example fails, a bad marker is refused, markers are read.

PAGE = """\
Text.

```python
x = 1
```

<!-- run: simulated slice -->

```python
with simulated_tpu_cluster("2x2x1", "TPU-V4"):
    pass
```

<!-- not run: needs a TPU slice -->
```py
import torch_tpu
```

  ```python
  y = x + 1
  ```

```bash
python -m ray_train_tpu plan --topology 4x4 --accelerator-type TPU-V6E
```
"""


def test_markers_are_read():
    found = D.examples(PAGE, "page.md")
    assert [(e.line, e.kind, e.note) for e in found] == [
        (3, D.LOCAL, ""), (9, D.SLICE, ""), (15, D.NOT_RUN, "needs a TPU slice"), (19, D.LOCAL, "")]
    assert found[3].code == "y = x + 1\n"
    ns = D.namespace("page.md")
    D.run([e for e in found if e.kind == D.LOCAL], ns)
    assert ns["y"] == 2


def test_a_failing_example_fails_naming_its_line():
    (ex,) = D.examples("# Page\n\n```python\nimport torch\n\ntorch.no_such_function()\n```\n", "docs/x.md")
    with pytest.raises(AssertionError, match=r"docs/x.md:3 failed: AttributeError"):
        D.run([ex], D.namespace("docs/x.md"))
    try:
        D.run([ex], D.namespace("docs/x.md"))
    except AssertionError as e:
        assert e.__cause__.__traceback__.tb_next.tb_lineno == 6  # the line in the page


@pytest.mark.parametrize("comment", ["<!-- not run -->", "<!-- not-run: TPU -->", "<!-- run: slice -->",
                                     "<!-- run by: -->", "<!-- TODO -->"])
def test_a_misspelt_marker_is_refused(comment):
    with pytest.raises(D.MarkerError, match="is not a marker"):
        D.examples(f"{comment}\n```python\nx = 1\n```\n", "docs/x.md")


def test_prompts_are_refused():
    with pytest.raises(D.MarkerError, match="without >>> prompts"):
        D.examples("```python\n>>> 1 + 1\n2\n```\n", "docs/x.md")
