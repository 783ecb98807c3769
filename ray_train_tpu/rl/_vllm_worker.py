"""What every vLLM worker (every TP rank) of a rollout engine runs for us.

`WeightSyncExtension` is vLLM's ``worker_extension_cls`` of every rollout
engine: vLLM mixes it into whatever worker the platform runs (vLLM's CPU
worker in simulation, vllm-torchtpu's ``TPUWorker`` on TPUs; vLLM's
weight-transfer API exists on its GPU worker only), and the engine calls its
methods with ``LLM.collective_rpc("rl_...")``. Weights load with the model's
own ``load_weights``, one bucket (shard) at a time (`receive`). All vLLM
internals go through `ray_train_tpu._compat.vllm`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Callable

from ray_train_tpu._compat import vllm as compat_vllm
from ray_train_tpu.rl import weights as W

# This process's last update: {hf name: rows of each trainer shard} (for parity).
_LAST = {"layout": None}


def receive(payload: dict, load_weights: Callable) -> None:
    """Load the buckets of ``payload`` (per bucket, the trainer ranks' ObjectRefs
    in rank order, from the `weights.WeightMailbox` actor named ``payload["mailbox"]``;
    in-process callers may give ``payload["buckets"]`` itself). A background
    thread fetches bucket k+1 while bucket k loads."""
    import ray

    if "buckets" in payload:
        buckets = payload["buckets"]
    else:
        mailbox = ray.get_actor(payload["mailbox"])
        buckets = ray.get(mailbox.get.remote(payload["version"]))[0]
    layout = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        fetches = [pool.submit(_fetch, list(refs)) for refs in buckets]
        for fetch in fetches:
            tensors, part = W.assemble(fetch.result())
            load_weights(tensors)
            layout.update(part)
            del tensors
    _LAST["layout"] = layout


def _fetch(refs: list) -> list:
    """A bucket of every trainer rank (ObjectRefs; in-process callers may pass the buckets)."""
    import ray

    return ray.get(refs) if refs and isinstance(refs[0], ray.ObjectRef) else refs


class _RotaryCacheFilter(logging.Filter):
    """vLLM's layerwise reload warns at every update that rotary embeddings
    "failed to load weights": their cos/sin cache is computed, never in a
    checkpoint, and vLLM keeps it as it was (what we want). Drop that line only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


logging.getLogger(compat_vllm.LAYERWISE_RELOAD_LOGGER).addFilter(_RotaryCacheFilter())


class WeightSyncExtension:
    """Mixed into vLLM's worker (any platform's); ``self`` is the worker."""

    def rl_load_weights(self, payload: dict) -> None:
        """Load the weights of ``payload`` (`receive`) into this worker's model, in place."""
        compat_vllm.reload_weights(self, lambda load_weights: receive(payload, load_weights))

    def rl_place(self) -> dict:
        """This worker's rank, TP rank, host and chip (for the engine's place check)."""
        import ray

        from ray_train_tpu._worker_fns import this_host

        ctx = ray.get_runtime_context()
        identity = this_host()  # GKE's variable, else Ray's label (a TPU VM has only the label)
        return {**compat_vllm.worker_place(self), "node_ip": ray.util.get_node_ip_address(),
                "chips": [int(c) for c in ctx.get_accelerator_ids().get("TPU", [])],
                "worker_id": identity.worker_id, "slice_name": identity.slice_name}

    def rl_tp_specs(self) -> dict:
        """``{hf name: (dim, start, length) or None}``: this TP rank's slice of each tensor."""
        model = compat_vllm.worker_model(self)
        packed = compat_vllm.packed_modules(model)
        out = {}
        for name, _, specs in compat_vllm.effective_weights(model):
            out.update(zip(W.hf_names(name, packed), specs))
        return out

    def rl_weight_digests(self) -> dict:
        """Digests of the weights the kernels compute with, cut into the blocks
        of the last update (see `ray_train_tpu.rl.weights`)."""
        import torch

        layout = _LAST["layout"]
        if layout is None:
            raise RuntimeError("weight digests before any weight update: nothing to compare with yet")
        model = compat_vllm.worker_model(self)
        packed = compat_vllm.packed_modules(model)
        place = compat_vllm.worker_place(self)
        tp_rank = place["tp_rank"] if place["tp_size"] > 1 else None
        out = {}
        with torch.inference_mode():
            for name, tensor, specs in compat_vllm.effective_weights(model):
                out.update(W.engine_digests(name, tensor, specs, tp_rank, packed, layout))
        return out
