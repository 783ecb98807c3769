"""Every touch of a private torch API, pinned to `constants.TORCH_VERSION`.

torch has no public way to ask which backend owns the PrivateUse1 device slot
(torch_tpu registers "tpu" there); ``torch._C._get_privateuse1_backend_name``
is what ``torch.utils.backend_registration`` itself reads.
"""

from __future__ import annotations

from ray_train_tpu import constants as C

TESTED_TORCH_VERSION = C.TORCH_VERSION


def privateuse1_backend_name() -> str:
    """The device name registered for PrivateUse1 (``"tpu"`` once torch_tpu
    loaded on a TPU host; torch's default ``"privateuseone"`` otherwise)."""
    import torch

    return torch._C._get_privateuse1_backend_name()


def version_matches(version: str) -> bool:
    """True when `version` (``torch.__version__``) is the pinned major.minor."""
    return version.split("+")[0].startswith(TESTED_TORCH_VERSION + ".")
