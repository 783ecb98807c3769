"""Methods added to every vLLM worker of a rollout engine (``worker_extension_cls``).

vLLM mixes this class into its ``Worker``; the engine calls the methods with
``LLM.collective_rpc("rl_...")``, so they run where the model lives.

- `rl_load_weights` loads a Hugging Face-named state dict through vLLM's own
  path for in-place updates, ``Worker.reload_weights(weights_iterator=...)``:
  each model's ``load_weights`` (which fuses q/k/v and gate/up), then vLLM's
  per-layer post-load processing again (on the CPU backend that repacks linear
  weights into oneDNN / AMX kernel layouts, so a plain ``param.copy_`` would
  leave the kernels computing with the old weights).
- `rl_weight_digests` reads back what the engine computes with. A linear
  layer's checkpoint-layout weight may no longer exist after that repacking, so
  it is read through the layer's own kernel: ``apply(layer, I)`` for the
  identity ``I`` returns ``W^T`` exactly in any float format (each output is one
  product by 1.0 plus zeros; only the sign of a zero can change, which
  `ray_train_tpu.rl.weights.digest` ignores). Other parameters (embeddings,
  norms) are read directly; embeddings without vLLM's vocabulary padding.

Touches vLLM internals (``Worker.reload_weights``, ``model_runner.get_model``,
``LinearBase``/``quant_method.apply``) checked against vllm 0.29.0 only.
"""

from __future__ import annotations

import torch

VLLM_VERSION_CHECKED = "0.29.0"


class WeightSyncExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker."""

    def rl_load_weights(self, state_dict: dict) -> int:
        """Load ``{hf_name: tensor}`` into the model; returns the number of tensors."""
        self.reload_weights(weights_iterator=iter(list(state_dict.items())), is_checkpoint_format=True)
        return len(state_dict)

    def rl_weight_digests(self, layout: dict) -> dict:
        """Digests of the model as its kernels see it, cut into the trainer's
        pieces and shards (``layout``: rows per shard of every Hugging Face-named
        tensor last loaded); see `ray_train_tpu.rl.weights.split_digests`."""
        from ray_train_tpu.rl.weights import split_digests

        model = self.model_runner.get_model()
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        out = {}
        with torch.inference_mode():
            for name, tensor in _effective_tensors(model):
                out.update(split_digests(name, tensor, packed, layout))
        return out


def _effective_tensors(model):
    """``(engine name, tensor)`` for every weight, as the model computes with it;
    a tensor shared by two modules (tied embeddings) once."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    seen, covered = set(), []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and getattr(module, "quant_method", None) is not None:
            covered.append(name + ".")
            yield name + ".weight", _effective_weight(module)
            if getattr(module, "bias", None) is not None:
                yield name + ".bias", module.bias
        elif isinstance(module, VocabParallelEmbedding):
            covered.append(name + ".")
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                # vLLM pads the vocabulary (to a multiple of 64): the rows past it are not the model's.
                yield name + ".weight", module.weight[: module.org_vocab_size]
    for name, param in model.named_parameters():
        if not any(name.startswith(p) for p in covered) and id(param) not in seen:
            seen.add(id(param))
            yield name, param


def _effective_weight(layer) -> torch.Tensor:
    """``W`` [out, in] of a linear layer, computed by the layer's own kernel."""
    dtype = layer.params_dtype
    size_in = layer.input_size_per_partition
    eye = torch.eye(size_in, dtype=dtype, device=_device(layer))
    return layer.quant_method.apply(layer, eye).t().contiguous()


def _device(layer) -> torch.device:
    for t in list(layer.parameters()) + list(layer.buffers()):
        if t.numel():
            return t.device
    return torch.device("cpu")
