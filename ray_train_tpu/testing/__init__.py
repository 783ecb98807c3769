"""Helpers users may import in their own tests: a simulated TPU cluster, the
actors still alive on it, gloo process groups spawned on this machine
(`ray_train_tpu.testing.gloo.run`), and a free port."""

from ray_train_tpu._host import free_port
from ray_train_tpu.testing import gloo
from ray_train_tpu.testing.cluster_state import alive_actors
from ray_train_tpu.testing.simulated_cluster import (
    SIMULATION_ENV,
    SimulatedTPUCluster,
    host_ip,
    simulated_tpu_cluster,
)

__all__ = ["SIMULATION_ENV", "SimulatedTPUCluster", "alive_actors", "free_port", "gloo", "host_ip",
           "simulated_tpu_cluster"]
