"""Every touch of torch_tpu's ``_internal`` package, pinned to `constants.TORCH_TPU_VERSION`.

Only for diagnosis: how many TPU chips this process can see
(``torch_tpu._internal.utils.hardware.get_tpu_device_count``).
"""

from __future__ import annotations

from typing import Optional

from ray_train_tpu import constants as C

TESTED_TORCH_TPU_VERSION = C.TORCH_TPU_VERSION


def tpu_chip_count() -> Optional[int]:
    """Chips torch_tpu sees on this host, or None when it cannot tell (not
    installed, or its probe failed: diagnosis must never raise)."""
    try:
        from torch_tpu._internal.utils import hardware

        return hardware.get_tpu_device_count()
    except Exception:  # diagnosis only
        return None
