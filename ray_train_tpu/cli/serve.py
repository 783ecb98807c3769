"""``serve``: the command lives with the serving code (`ray_train_tpu.serve.cli`)."""

from __future__ import annotations

ORDER = 90


def register(subparsers, add_slice_args) -> None:
    from ray_train_tpu.serve.cli import register as register_serve

    register_serve(subparsers, add_slice_args)
