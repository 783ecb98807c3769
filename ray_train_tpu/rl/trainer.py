"""`TrainerGroup`: the `PolicyWorker` actors on every device of the trainer's
slice (or half), in rank order, and calls on all of them at once."""

from __future__ import annotations


def is_actor_failure(e: BaseException) -> bool:
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError))


class TrainerGroup:
    """One `PolicyWorker` per device of a `SliceReservation`, joined in one process group."""

    def __init__(self, reservation, worker_kwargs: dict):
        self.reservation, self.worker_kwargs = reservation, worker_kwargs
        self.actors: list = []

    def start(self) -> dict:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ray_train_tpu.actors import setup_process_group
        from ray_train_tpu.rl.policy import PolicyWorker

        cls = ray.remote(PolicyWorker)
        pg = self.reservation.placement_group
        actors = []
        for device in self.reservation.devices:
            env = self.reservation.env(device)  # a half of a slice, described as a slice of its own
            options = dict(num_cpus=1, resources={"TPU": 1}, max_restarts=0, scheduling_strategy=
                           PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=device.bundle))
            if env:
                options["runtime_env"] = {"env_vars": env}
            actors.append(cls.options(**options).remote(**self.worker_kwargs))
        self.actors = setup_process_group(actors)
        return self.call("build")[0]

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def call(self, method: str, *args) -> list:
        """``method`` on every rank; raises the first failure without waiting for
        ranks that may hang in a collective with a dead peer."""
        import ray

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as first:
                # A dead rank makes its peers' collectives fail too: report the death, the cause.
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
                for ref in done:
                    try:
                        ray.get(ref)
                    except Exception as e:
                        if is_actor_failure(e):
                            raise e from None
                raise first
        return ray.get(refs)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
