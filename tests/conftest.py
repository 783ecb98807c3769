"""Shared test set-up. Runs before any test module imports torch."""

import os

# libtpu must never query the cloud metadata server (off limits here; a stall of
# minutes), and torch must not autoload torch_tpu in tests: set both before torch
# is imported in this process and in every process it starts.
os.environ["TPU_SKIP_MDS_QUERY"] = "1"
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
