"""RL post-training on TPU slices: GRPO with a trainer slice and vLLM rollout engines.

- `GRPOLoop` / `GRPOConfig` / `AlgorithmConfig` / `SamplingConfig`: the loop
  and everything it can be told (``loop.py``, ``config.py``);
- ``policy.py`` / ``trainer.py``: the trainer, FSDP2 over the trainer's slice
  (Ray actors joined by `ray_train_tpu.setup_process_group`);
- ``rollout.py`` / ``pool.py``: vLLM engines of any size on the rollout slice;
- ``slices.py``: two slices, or two halves of one (``one_slice=True``);
- ``weights.py`` / ``_vllm_worker.py``: weight sync through Ray's object store
  into vLLM's weight-transfer API, and the bitwise parity check;
- ``grpo.py``: the formulas; ``data.py`` / ``rewards.py`` / ``step.py``: prompts,
  rewards in Ray tasks, batches; ``tasks.py``: ready-made records and rewards;
  ``models.py``: offline model directories; ``cli.py``: ``python -m ray_train_tpu rl-demo``.

Names are imported on first use (the CLI imports this package without torch).
The docs page ``docs/rl.md`` has a quick start and every option.

Example:
    >>> from ray_train_tpu.rl import GRPOConfig, GRPOLoop, addition_records, strict_answer_reward
    >>> config = GRPOConfig(model_dir=tiny_addition_model(), prompts=addition_records(),   # doctest: +SKIP
    ...                     reward_fn=strict_answer_reward, lr=3e-3)
    >>> with GRPOLoop(config) as loop:                                                     # doctest: +SKIP
    ...     history = loop.run(30)
"""

import importlib

_PUBLIC = {
    "GRPOConfig": "ray_train_tpu.rl.config",
    "AlgorithmConfig": "ray_train_tpu.rl.config",
    "SamplingConfig": "ray_train_tpu.rl.config",
    "GRPOLoop": "ray_train_tpu.rl.loop",
    "WeightSyncError": "ray_train_tpu.rl.loop",
    "RewardError": "ray_train_tpu.rl.rewards",
    "addition_records": "ray_train_tpu.rl.tasks",
    "chat_addition_records": "ray_train_tpu.rl.tasks",
    "word_problem_records": "ray_train_tpu.rl.tasks",
    "strict_answer_reward": "ray_train_tpu.rl.tasks",
    "gsm8k_reward": "ray_train_tpu.rl.tasks",
    "tiny_addition_model": "ray_train_tpu.rl.models",
    "tiny_chat_model": "ray_train_tpu.rl.models",
    "smollm2_dir": "ray_train_tpu.rl.models",
}
__all__ = sorted(_PUBLIC)

# Names of the first RL API (removed) and what replaces them.
_REMOVED = {
    "Task": "records: GRPOConfig(prompts=[{'prompt': ..., <fields>}], reward_fn=...) takes any iterable of dicts, "
            "a Ray Dataset or a datasets.Dataset; e.g. prompts=addition_records(), reward_fn=strict_answer_reward",
    "Prompt": "a record (a dict with a 'prompt' field, or GRPOConfig(prompt_key=...)); reward_fn(prompt, completion, "
              "**fields) receives its other fields by name",
    "addition_task": "addition_records() (records) with reward_fn=strict_answer_reward",
    "chat_addition_task": "chat_addition_records() (records) with reward_fn=strict_answer_reward",
}


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name in _REMOVED:
        # ImportError, not AttributeError: `from ray_train_tpu.rl import Task` would replace an
        # AttributeError's message with its own "cannot import name".
        raise ImportError(f"ray_train_tpu.rl.{name} was removed with the first RL API; use {_REMOVED[name]} "
                          "(see docs/rl.md)", name=name)
    raise AttributeError(f"module 'ray_train_tpu.rl' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
