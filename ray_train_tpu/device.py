"""`get_device()`: the torch device of this worker, the same way in every mode.

- explicit simulation (``RAY_TRAIN_TPU_SIMULATE=1``): ``cpu``;
- a worker holding a TPU: ``tpu``, after checking that torch_tpu registered it
  (an error naming what is missing otherwise, never a CPU fallback);
- anything else: what ``ray.train.torch.get_device()`` says (``cuda:N`` or ``cpu``).
"""

from __future__ import annotations

from ray_train_tpu import _environ
from ray_train_tpu import constants as C


def is_simulated() -> bool:
    """True in a process of an explicitly simulated TPU slice."""
    return _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"


def get_device():
    """The torch device for this worker.

    Example:
        >>> model = model.to(ray_train_tpu.get_device())  # doctest: +SKIP
    """
    import torch

    if is_simulated():
        return torch.device("cpu")
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_accelerator_ids().get("TPU"):
        from ray_train_tpu import _worker

        _worker.check_tpu_runtime()
        return torch.device("tpu")
    import ray.train.torch

    return ray.train.torch.get_device()
