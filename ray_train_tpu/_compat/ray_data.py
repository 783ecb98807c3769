"""Ray Data's internals that we lean on, pinned to `constants.RAY_VERSION`;
tests/unit/test_compat.py reads each from Ray Data's own source.

- `starting_an_actor`: whether a map stage's ``ray_remote_args_fn`` is being
  called to start one of the stage's actors (``ActorPoolMapOperator._start_actor``)
  or for something else (the high-memory issue detector, which calls every map
  stage's function to read its ``memory`` request). Batch inference's function
  reserves a slice per call (`serve.batch.engine_remote_args`).
"""

from __future__ import annotations

import sys

# Where Ray Data starts an actor of an actor-pool map stage, calling the stage's
# ``ray_remote_args_fn`` (through ``_merge_ray_remote_args``) for its remote args.
ACTOR_START = ("actor_pool_map_operator.py", "_start_actor")


def starting_an_actor() -> bool:
    """Whether this call (a stage's ``ray_remote_args_fn``) is Ray Data starting
    an actor of the stage. Ray Data calls the function for other reasons too:
    its high-memory issue detector calls every map stage's function when the
    execution starts and periodically after (``_get_dynamic_ray_remote_args``),
    only to read a ``memory`` request. A function that reserves a slice per
    call must reserve only here."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == ACTOR_START[1] and code.co_filename.endswith(ACTOR_START[0]):
            return True
        frame = frame.f_back
    return False
