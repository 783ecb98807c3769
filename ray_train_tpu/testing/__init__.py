"""Helpers users may import in their own tests: a simulated TPU cluster."""

from ray_train_tpu.testing.simulated_cluster import (
    SIMULATION_ENV,
    SimulatedTPUCluster,
    host_ip,
    simulated_tpu_cluster,
)

__all__ = ["SIMULATION_ENV", "SimulatedTPUCluster", "host_ip", "simulated_tpu_cluster"]
