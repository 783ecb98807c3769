"""The demo command's argument checks (the demo itself runs in `make demo`)."""

import io

from ray_train_tpu.cli import main


def test_demo_rejects_bad_input_before_starting_anything():
    err = io.StringIO()
    assert main(["demo", "--topology", "4x5"], out=io.StringIO(), err=err) == 2
    assert "valid: 1x1" in err.getvalue()
    err = io.StringIO()
    assert main(["demo", "--steps", "0"], out=io.StringIO(), err=err) == 2
    assert "--steps must be an integer in 1..100000, got 0" in err.getvalue()
