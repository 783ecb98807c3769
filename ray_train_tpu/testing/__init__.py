"""Helpers users may import in their own tests: a simulated TPU cluster, the
actors still alive on it, and gloo process groups spawned on this machine."""

from ray_train_tpu.testing.cluster_state import alive_actors
from ray_train_tpu.testing.simulated_cluster import (
    SIMULATION_ENV,
    SimulatedTPUCluster,
    host_ip,
    simulated_tpu_cluster,
)

__all__ = ["SIMULATION_ENV", "SimulatedTPUCluster", "alive_actors", "host_ip", "simulated_tpu_cluster"]
