"""``rl-demo``: the command lives with the RL code (`ray_train_tpu.rl.cli`)."""

from __future__ import annotations

ORDER = 95
EXAMPLE = "python -m ray_train_tpu rl-demo --steps 30 --out rl_demo"


def register(subparsers, add_slice_args) -> None:
    from ray_train_tpu.rl.cli import register as register_rl

    register_rl(subparsers, add_slice_args)
