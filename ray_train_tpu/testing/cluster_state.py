"""What is still running on a (simulated) cluster: for tests that check clean-up."""

from __future__ import annotations


def alive_actors() -> list[dict]:
    """Alive actors of the connected cluster (class name, node, pid), read from
    the GCS, so that it works without the dashboard's state API.

    Example:
        >>> [a["class_name"] for a in alive_actors()]   # doctest: +SKIP
        ['RayTrainWorker', 'RayTrainWorker']
    """
    from ray_train_tpu._compat import ray_train as compat_ray

    return [
        {
            "class_name": info.get("ActorClassName"),
            "node_ip": (info.get("Address") or {}).get("IPAddress"),
            "pid": info.get("Pid"),
        }
        for info in compat_ray.gcs_actor_table()
        if info.get("State") == "ALIVE"
    ]
