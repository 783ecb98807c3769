"""``python -m ray_train_tpu doctor``: a running Ray cluster's TPU slices, and what is wrong with them.

It reads every alive node from ``ray.nodes()`` (resources and the labels Ray's
TPU scheduling uses), runs a tiny task pinned to each TPU host (no CPU, no TPU,
never imports torch or torch_tpu), and reports slices, hosts and problems as a
table or as JSON. Exit status: 0 healthy, 1 a problem found, 2 bad input or no
cluster to talk to.

Checks (the ``check`` field of each problem):

- ``no_tpu_hosts``: no alive node has a TPU resource or a ``ray.io/tpu-*`` label.
- ``missing_label``, ``bad_worker_id``: a TPU host lacks one of Ray's TPU labels,
  or ``ray.io/tpu-worker-id`` is not a non-negative integer.
- ``inconsistent_labels``: hosts of one slice disagree on topology, pod type or generation.
- ``bad_topology``: ``ray.io/tpu-topology`` is not a slice of that generation.
- ``pod_type_mismatch``: ``ray.io/tpu-pod-type`` is not the topology's (``2x2x2`` is ``v4-16``).
- ``missing_host``, ``duplicate_worker_id``, ``unexpected_worker_id``: a slice's
  worker ids are not exactly 0..hosts-1 of its topology.
- ``missing_head_resource``, ``misplaced_head_resource``: worker 0 lacks
  ``TPU-<pod type>-head`` (Ray reserves a slice through it), or another host has it.
- ``chip_count_mismatch``: hosts of one slice have different chip counts.
- ``topology_chips_mismatch``: a host's chips are not the topology's chips per
  host (hosts x chips per host must make the slice).
- ``resource_per_chip``: ``RAY_TPU_RESOURCE_PER_CHIP`` is not the TorchTPU
  devices per chip (2 on v7x, unset or 1 elsewhere).
- ``torch_tpu_missing``, ``libtpu_missing``: the package cannot be found on the host.
- ``lockfile_held``: a process holds libtpu's lockfile, so torch_tpu cannot open the chips.
- ``env_label_mismatch``: a host's ``TPU_*`` variables disagree with its labels
  (labels set by hand override what Ray derives from them).
- ``version_mismatch``: TPU hosts have different torch_tpu or libtpu versions.
- ``host_check_timeout``, ``host_check_failed``: a host's check did not answer in
  time (``--timeout``) or raised.

Example:
    >>> nodes = [{"NodeID": "n0", "Alive": True, "NodeManagerAddress": "10.0.0.2",
    ...           "Resources": {"TPU": 4.0, "TPU-v4-8-head": 1.0},
    ...           "Labels": {"ray.io/tpu-slice-name": "s", "ray.io/tpu-worker-id": "0",
    ...                      "ray.io/tpu-pod-type": "v4-8", "ray.io/tpu-topology": "2x2x1",
    ...                      "ray.io/accelerator-type": "TPU-V4"}}]
    >>> diagnose(nodes)["healthy"]
    True
"""


from ray_train_tpu.doctor.checks import (
    ACCELERATOR_LABEL,
    POD_TYPE_LABEL,
    SLICE_LABEL,
    TOPOLOGY_LABEL,
    TPU_LABELS,
    WORKER_ID_LABEL,
    check_host,
    check_slice,
    check_versions,
    diagnose,
    tpu_hosts,
)
from ray_train_tpu.doctor.cluster import (
    DEFAULT_TIMEOUT_S,
    RAY_ADDRESS,
    connect,
    probe_hosts,
    resolve_address,
    run_doctor,
)
from ray_train_tpu.doctor.probe import (
    SIMULATE_LIBTPU_LOCKFILE,
    SIMULATE_MISSING_MODULES,
    lockfile_holder,
    probe_host,
)
from ray_train_tpu.doctor.report import FORMATS, format_report_table

__all__ = [
    "ACCELERATOR_LABEL", "DEFAULT_TIMEOUT_S", "FORMATS", "POD_TYPE_LABEL", "RAY_ADDRESS",
    "SIMULATE_LIBTPU_LOCKFILE", "SIMULATE_MISSING_MODULES", "SLICE_LABEL", "TOPOLOGY_LABEL", "TPU_LABELS",
    "WORKER_ID_LABEL", "check_host", "check_slice", "check_versions", "connect", "diagnose",
    "format_report_table", "lockfile_holder", "probe_host", "probe_hosts", "resolve_address", "run_doctor",
    "tpu_hosts",
]
