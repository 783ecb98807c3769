"""ray_train_tpu.huggingface: why it exists (read from accelerate's and transformers' own
code, so an upgrade that makes the Trainer distributed on TorchTPU fails here) and what it
leaves alone. The distributed test (tests/distributed/test_trainer_on_slice.py) trains with it."""

import inspect

import pytest

transformers = pytest.importorskip("transformers")


def test_accelerate_has_no_distributed_type_for_torch_tpu():
    from accelerate.utils import DistributedType
    from accelerate.utils.constants import TORCH_DISTRIBUTED_BACKENDS
    from transformers import TrainingArguments

    assert "tpu" not in TORCH_DISTRIBUTED_BACKENDS and "cuda" in TORCH_DISTRIBUTED_BACKENDS
    assert not hasattr(DistributedType, "MULTI_TPU")
    # transformers' TorchTPU device choice sits in the single-process (DistributedType.NO) branch
    source = inspect.getsource(TrainingArguments._setup_devices.func)
    no_branch = source[source.index("distributed_type == DistributedType.NO"):]
    assert 'torch.device("tpu:0")' in no_branch


def test_a_single_process_trainer_is_left_as_rays_prepare_trainer_leaves_it(tmp_path):
    import torch
    from ray.train.huggingface.transformers import RayTrainReportCallback
    from transformers import Trainer, TrainingArguments

    from ray_train_tpu.huggingface import prepare_trainer

    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = prepare_trainer(Trainer(model=model, args=args, callbacks=[RayTrainReportCallback()]))
    assert args.output_dir == str(tmp_path)
    assert any(type(c) is RayTrainReportCallback for c in trainer.callback_handler.callbacks)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_rank_zero_checkpoints_keeps_rays_checkpoint_layout():
    from ray.train.huggingface.transformers import RayTrainReportCallback

    from ray_train_tpu.huggingface import _rank_zero_checkpoints_class

    cls = _rank_zero_checkpoints_class()
    assert issubclass(cls, RayTrainReportCallback) and cls.CHECKPOINT_NAME == RayTrainReportCallback.CHECKPOINT_NAME
    # Ray's on_save takes the same metrics (every log merged) and checkpoint (the last one in output_dir)
    ray_on_save = inspect.getsource(RayTrainReportCallback.on_save)
    assert "for log in state.log_history" in ray_on_save and "get_last_checkpoint(args.output_dir)" in ray_on_save
