"""Ray Train on Google Cloud TPU slices, with native PyTorch (torch_tpu).

Public API: `Topology`, `TPUScalingConfig`, `TPUTorchConfig`, `TPUTorchTrainer`,
`get_device`, `compute_dtype`, `prepare_model`,
`setup_process_group` / `shutdown_process_group` (plain Ray actors). Names are imported on first use, so
that ``python -m ray_train_tpu plan`` starts without importing Ray or torch.

Example:
    >>> from ray_train_tpu import TPUScalingConfig
    >>> TPUScalingConfig(topology="4x4", accelerator_type="TPU-V6E").num_workers
    16
"""

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Topology": "ray_train_tpu.topology",
    "TPUScalingConfig": "ray_train_tpu.scaling",
    "TPUTorchConfig": "ray_train_tpu.config",
    "TPUTorchTrainer": "ray_train_tpu.trainer",
    "get_device": "ray_train_tpu.device",
    "compute_dtype": "ray_train_tpu.device",
    "prepare_model": "ray_train_tpu.prepare",
    "setup_process_group": "ray_train_tpu.actors",
    "shutdown_process_group": "ray_train_tpu.actors",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ray_train_tpu' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
