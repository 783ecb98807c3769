"""The Hugging Face Trainer on a TPU slice: Ray's recipe, plus the data parallelism it lacks there.

Ray's recipe (``ray.train.huggingface.transformers``: ``prepare_trainer`` and
``RayTrainReportCallback``) relies on accelerate to make the Trainer data-parallel.
accelerate 1.16 has no distributed type for TorchTPU's ``tpu`` device (its
``TORCH_DISTRIBUTED_BACKENDS`` has no ``tpu`` entry, so ``PartialState`` says
``DistributedType.NO``), and transformers 5.25 supports TorchTPU only on that
single-process path (``TrainingArguments`` puts the model on ``tpu:0``). Under
``TPUTorchTrainer`` each of the N workers would then train its own replica on its
own data shard, with gradients never averaged, and every worker would save as
"process 0" into the same ``output_dir`` and report its own checkpoint.

`prepare_trainer` is Ray's ``prepare_trainer`` plus, when the process group spans
more than one rank and the Trainer is not distributed itself:

- parameters and buffers broadcast from rank 0 (as DDP does at construction);
- every gradient averaged over the ranks as it is accumulated in backward
  (``register_post_accumulate_grad_hook``; DDP's result, without its bucketing), so
  clipping, the logged ``grad_norm`` and the optimizer step see the global
  gradient on every rank;
- ranks other than 0 save into ``<output_dir>/rank<k>``, so that workers of one
  host never write the same files;
- Ray's ``RayTrainReportCallback`` replaced by `RankZeroCheckpoints`, which reports
  the checkpoint from rank 0 only (Ray Train keeps the first rank's checkpoint of a
  report, and ranks' copies would otherwise race into one storage directory).

Example:
    >>> trainer = Trainer(model=model, args=args, train_dataset=shard.iter_torch_batches(batch_size=8),
    ...                   callbacks=[RayTrainReportCallback()])          # doctest: +SKIP
    >>> trainer = ray_train_tpu.huggingface.prepare_trainer(trainer)    # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)


def _ray_report_callback():
    from ray.train.huggingface.transformers import RayTrainReportCallback

    return RayTrainReportCallback


def _rank_zero_checkpoints_class():
    import ray.train
    import transformers.trainer

    base = _ray_report_callback()

    class RankZeroCheckpoints(base):
        """``RayTrainReportCallback`` with the checkpoint reported from world rank 0 only
        (every rank still reports the metrics: ``ray.train.report`` is a barrier)."""

        def on_save(self, args, state, control, **kwargs):
            metrics = {}
            for log in state.log_history:
                metrics.update(log)
            if ray.train.get_context().get_world_rank() != 0:
                ray.train.report(metrics=metrics)
                return
            with tempfile.TemporaryDirectory() as tmp:
                source = transformers.trainer.get_last_checkpoint(args.output_dir)
                checkpoint = None
                if source is not None:
                    shutil.copytree(source, os.path.join(tmp, self.CHECKPOINT_NAME))
                    checkpoint = ray.train.Checkpoint.from_directory(tmp)
                ray.train.report(metrics=metrics, checkpoint=checkpoint)

    return RankZeroCheckpoints


def prepare_trainer(trainer):
    """Ray's ``prepare_trainer(trainer)``, made data-parallel across the slice's ranks
    where the Trainer itself is not (TorchTPU under accelerate 1.16; see the module
    docstring). Call it in the training function after building the Trainer and
    before ``trainer.train()``; a Trainer that is distributed already (CUDA, CPU with
    gloo) is returned as Ray's ``prepare_trainer`` returns it."""
    import torch.distributed as dist
    from ray.train.huggingface.transformers import prepare_trainer as ray_prepare_trainer
    from transformers.training_args import ParallelMode

    trainer = ray_prepare_trainer(trainer)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return trainer
    if trainer.args.parallel_mode == ParallelMode.DISTRIBUTED:
        return trainer
    rank, world = dist.get_rank(), dist.get_world_size()
    _replicate(trainer.model)
    _average_gradients(trainer.model, world)
    if rank != 0:
        trainer.args.output_dir = os.path.join(trainer.args.output_dir, f"rank{rank}")
    ray_callback = _ray_report_callback()
    if any(type(c) is ray_callback for c in trainer.callback_handler.callbacks):
        trainer.remove_callback(ray_callback)
        trainer.add_callback(_rank_zero_checkpoints_class()())
    logger.info("ray_train_tpu: the HF Trainer is not distributed on %s (accelerate has no distributed type for "
                "it); gradients are averaged over %d ranks by ray_train_tpu.huggingface", trainer.args.device, world)
    return trainer


def _replicate(model) -> None:
    import torch.distributed as dist

    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def _average_gradients(model, world: int) -> None:
    import torch.distributed as dist

    def average(param) -> None:
        dist.all_reduce(param.grad)
        param.grad.div_(world)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)
