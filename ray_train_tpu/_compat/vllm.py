"""Every touch of vLLM internals, pinned to `constants.VLLM_VERSION` (0.29.0).

tests/unit/test_compat.py checks that each seam below still exists in the
installed vLLM. Nothing outside ``_compat`` imports a private vLLM name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional

from ray_train_tpu import constants as C

if TYPE_CHECKING:
    import torch

TESTED_VLLM_VERSION = C.VLLM_VERSION


# --- rl: weight sync into rollout engines ----------------------------------------------
#
# Weights reach a rollout engine through vLLM's own RL weight-transfer API
# (``LLM.start_weight_update`` / ``update_weights`` / ``finish_weight_update``,
# ``vllm/distributed/weight_transfer``): a backend registered with
# ``WeightTransferEngineFactory`` receives each update on every worker (TP rank)
# and loads it with the model's ``load_weights`` between vLLM's layerwise-reload
# bracket (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), which
# re-runs each layer's post-load processing (on the CPU backend: the repacking
# of linear weights into oneDNN layouts). Our backend takes Ray object-store
# references; what they hold and how they become tensors is the caller's
# (`register_weight_transfer(receive=...)`).
#
# Parity reads back what the kernels compute with: a linear layer through its
# own ``quant_method.apply(layer, I)`` (exact: W^T), embeddings without vLLM's
# vocabulary padding, and, with tensor parallelism, which slice of each Hugging
# Face tensor this rank holds (`tp_pieces`), from the layers' own attributes.

WEIGHT_TRANSFER_BACKEND = "ray_object_store"
LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
# One slice of a Hugging Face tensor held by a TP rank: (dim, start, length); None = all of it.
TPSpec = Optional[tuple[int, int, int]]


def register_weight_transfer(receive: Callable[[dict, Callable], None]) -> None:
    """Register the ``ray_object_store`` weight-transfer backend in this process
    (every vLLM worker process must, before its model loads). ``receive(update_info,
    load_weights)`` gets each ``update_weights`` payload and calls
    ``load_weights(iterable of (hf_name, tensor))`` as often as it likes."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if WEIGHT_TRANSFER_BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(WEIGHT_TRANSFER_BACKEND, _engine_class(receive))


def _engine_class(receive):
    from dataclasses import dataclass, field

    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    @dataclass
    class ObjectStoreInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class ObjectStoreUpdateInfo(WeightTransferUpdateInfo):
        payload: dict = field(default_factory=dict)

    class ObjectStoreWeightTransfer(WeightTransferEngine):
        init_info_cls = ObjectStoreInitInfo
        update_info_cls = ObjectStoreUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info) -> None:
            receive(update_info.payload, self.model.load_weights)

        def update_weights(self, update_info: dict) -> None:
            # The base class ends with torch.accelerator.synchronize(), which
            # has no CPU backend; our loads are synchronous copies anyway.
            self.receive_weights(self.parse_update_info(update_info))

        def shutdown(self) -> None:
            pass

    return ObjectStoreWeightTransfer


def worker_model(worker) -> "torch.nn.Module":
    """The model a vLLM worker runs (``Worker.model_runner.get_model()``)."""
    return worker.model_runner.get_model()


def worker_place(worker) -> dict:
    """What a vLLM worker is: its rank in the engine and its TP rank/size."""
    from vllm.distributed import parallel_state

    return {"rank": int(worker.rank), "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size()}


def effective_weights(model) -> Iterator[tuple[str, "torch.Tensor", list[TPSpec]]]:
    """``(engine name, tensor, specs)`` for every weight as the model computes
    with it (a tensor shared by two modules, tied embeddings, once). The tensor
    is this TP rank's part; ``specs`` has one entry per Hugging Face piece of a
    fused tensor (q, k, v of ``qkv_proj``), in order, or one for a plain one."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    seen, covered = set(), []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and getattr(module, "quant_method", None) is not None:
            covered.append(name + ".")
            specs = linear_specs(module)
            yield name + ".weight", _effective_weight(module), specs
            if getattr(module, "bias", None) is not None:
                yield name + ".bias", module.bias, specs if specs[0] is None or specs[0][0] == 0 else [None]
        elif isinstance(module, VocabParallelEmbedding):
            covered.append(name + ".")
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                idx = module.shard_indices
                rows = idx.org_vocab_end_index - idx.org_vocab_start_index
                # vLLM pads the vocabulary (to a multiple of 64): rows past it are not the model's.
                spec = None if module.tp_size == 1 else (0, idx.org_vocab_start_index, rows)
                yield name + ".weight", module.weight[:rows], [spec]
    for name, param in model.named_parameters():
        if not any(name.startswith(p) for p in covered) and id(param) not in seen:
            seen.add(id(param))
            yield name, param, [None]


def linear_specs(layer) -> list[TPSpec]:
    """Which slice of each Hugging Face piece a TP rank's linear layer holds."""
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)

    tp, rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
    if isinstance(layer, QKVParallelLinear):
        kv_rank = rank // layer.num_kv_head_replicas
        q, kv, v = (layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size,
                    layer.num_kv_heads * layer.v_head_size)
        specs = [(0, rank * q, q), (0, kv_rank * kv, kv), (0, kv_rank * v, v)]
    elif isinstance(layer, MergedColumnParallelLinear):
        specs = [(0, rank * (s // tp), s // tp) for s in layer.output_sizes]
    elif isinstance(layer, ColumnParallelLinear):
        specs = [(0, rank * layer.output_size_per_partition, layer.output_size_per_partition)]
    elif isinstance(layer, RowParallelLinear):
        specs = [(1, rank * layer.input_size_per_partition, layer.input_size_per_partition)]
    else:
        specs = [None] * len(getattr(layer, "output_sizes", None) or [1])
    return [None] * len(specs) if tp == 1 else specs


def _effective_weight(layer) -> "torch.Tensor":
    """``W`` [out, in] of this rank's linear layer, computed by its own kernel."""
    import torch

    eye = torch.eye(layer.input_size_per_partition, dtype=layer.params_dtype, device=_device(layer))
    return layer.quant_method.apply(layer, eye).t().contiguous()


def _device(layer) -> "torch.device":
    import torch

    for t in list(layer.parameters()) + list(layer.buffers()):
        if t.numel():
            return t.device
    return torch.device("cpu")


def packed_modules(model) -> dict:
    """``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``: the model's fused modules."""
    return dict(getattr(model, "packed_modules_mapping", {}) or {})
