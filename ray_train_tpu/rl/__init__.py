"""RL post-training on TPU slices: GRPO with a trainer slice and a vLLM rollout slice.

- `GRPOLoop` / `GRPOConfig` (``loop.py``): the loop, driven from one controller;
- ``policy.py``: the trainer, FSDP2 over every chip of slice A (Ray actors joined
  by `ray_train_tpu.setup_process_group`; why not Ray Train workers: its docstring);
- ``rollout.py``: vLLM engines on slice B, retried when one dies;
- ``weights.py`` / ``_vllm_worker.py``: weight sync through Ray's object store into
  vLLM's own loader, and the bitwise parity check;
- ``grpo.py``: advantages and loss; ``tasks.py``: prompts and verifiable rewards;
  ``models.py``: offline model directories; ``cli.py``: ``python -m ray_train_tpu rl-demo``.

Names are imported on first use (the CLI imports this package without torch).

Example:
    >>> from ray_train_tpu.rl import GRPOConfig, GRPOLoop, tiny_addition_model   # doctest: +SKIP
    >>> with GRPOLoop(GRPOConfig(model_dir=tiny_addition_model())) as loop:      # doctest: +SKIP
    ...     history = loop.run(30)
"""

import importlib

_PUBLIC = {
    "GRPOConfig": "ray_train_tpu.rl.loop",
    "GRPOLoop": "ray_train_tpu.rl.loop",
    "WeightSyncError": "ray_train_tpu.rl.loop",
    "SamplingConfig": "ray_train_tpu.rl.rollout",
    "Prompt": "ray_train_tpu.rl.tasks",
    "Task": "ray_train_tpu.rl.tasks",
    "addition_task": "ray_train_tpu.rl.tasks",
    "chat_addition_task": "ray_train_tpu.rl.tasks",
    "strict_answer_reward": "ray_train_tpu.rl.tasks",
    "tiny_addition_model": "ray_train_tpu.rl.models",
    "smollm2_dir": "ray_train_tpu.rl.models",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ray_train_tpu.rl' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
