"""TPUTorchTrainer on a simulated v4 2x2x1 slice (one host, 4 chips).

1. Numerical equivalence: DDP, FSDP2, TP and FSDP2+TP give the parameters and
   losses of a single-process reference trained on the full batch, with data from
   ``stateful_dataloader`` (and Ray's ``prepare_data_loader``) sharded by the
   strategy's data-parallel ranks: tensor-parallel peers read the same rows.
2. Drop-in: an ordinary TorchTrainer training loop runs unchanged, on the
   simulated "tpu" device (Ray's own prepare_data_loader moves its batches);
   Ray Data datasets are sharded over the ranks (checked in the HF run, 4).
3. A planted slip (a host batch fed to the device model) fails as on a TPU,
   naming both devices.
4. The Hugging Face Trainer (Ray's prepare_trainer + RayTrainReportCallback recipe)
   trains on the device on every rank, reports metrics and checkpoints, and resumes
   from the last committed checkpoint after a worker dies.
"""

import json
from pathlib import Path

import pytest
import ray
import ray.train
import torch
from torch import nn

from ray_train_tpu import TPUScalingConfig, TPUTorchTrainer
from ray_train_tpu.strategies import FSDP2TPStrategy, TensorParallelStrategy

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL = "2x2x1", "TPU-V4"
STEPS, GLOBAL_BATCH, LR = 4, 32, 0.05
# Parameters after a few float32 SGD steps may differ only by reduction order
# (sums over shards vs one sum): ~1e-7 relative. 1e-5 is far below any real
# mistake (a missing gradient average changes them by ~1e-2).
ATOL = 1e-5


SIMULATED_SLICE = dict(topology=TOPOLOGY, accelerator_type=ACCEL)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def _dataset():
    """Every step's batch in step order, each row with its index."""
    from torch.utils.data import TensorDataset

    xs, ys = zip(*(_batch(step) for step in range(STEPS)))
    x, y = torch.cat(xs), torch.cat(ys)
    return TensorDataset(torch.arange(len(x)), x, y)


def _reference():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def _equivalence_loop(config):
    """Train on the batches of `stateful_dataloader` (no rank given: the strategy's
    data-parallel ranks), and record which rows each rank read, the rows Ray's
    own ``prepare_data_loader`` would have given it, its losses and its
    tensor-parallel peers as torch's DeviceMesh has them."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    import ray.train.torch
    import ray_train_tpu
    from ray_train_tpu.data import stateful_dataloader
    from ray_train_tpu.prepare import current_strategy

    device = ray_train_tpu.get_device()
    model = ray_train_tpu.prepare_model(_mlp())
    data = _dataset()
    loader = stateful_dataloader(data, global_batch_size=GLOBAL_BATCH, shuffle=False)
    ray_loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=loader.batch_size))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, losses = [], []
    for idx, x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        ids.append(idx.tolist())
        losses.append(loss.item())
    mesh = current_strategy()._mesh
    record = {
        "ids": ids, "losses": losses, "ray_ids": [idx.cpu().tolist() for idx, _, _ in ray_loader],
        "tp_peers": mesh["tp"].mesh.flatten().tolist() if mesh is not None else [dist.get_rank()],
        "shard": current_strategy().distributed_sampler_kwargs,
    }
    Path(config["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({k: v.clone() for k, v in full.items()}, Path(config["out"]) / "params.pt")


_TP_PLAN = None


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _strategies():
    return {
        "ddp": "ddp",
        "fsdp2": "fsdp2",
        "tp": TensorParallelStrategy(plan=_tp_plan(), tp_size=4),
        "fsdp2+tp": FSDP2TPStrategy(plan=_tp_plan(), tp_size=2),
    }


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "tp", "fsdp2+tp"])
def test_strategy_matches_single_process_reference(sim, tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    result = TPUTorchTrainer(
        _equivalence_loop,
        train_loop_config={"out": str(out)},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "s"), failure_config=ray.train.FailureConfig(max_failures=0)),
        strategy=_strategies()[name],
    ).fit()
    assert result.error is None
    got = torch.load(out / "params.pt")
    want, want_losses = _reference()
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < ATOL, f"{name}: max abs diff {worst:.3g}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    expected_replicas = {"ddp": 4, "fsdp2": 4, "tp": 1, "fsdp2+tp": 2}[name]
    assert {rank["shard"]["num_replicas"] for rank in ranks} == {expected_replicas}
    # Tensor-parallel peers (torch's DeviceMesh "tp" groups) read identical batches,
    # data-parallel groups disjoint ones that make up each step's global batch;
    # Ray's prepare_data_loader hands every rank the same rows as stateful_dataloader.
    groups = {tuple(rank["tp_peers"]) for rank in ranks}
    assert len(groups) == expected_replicas
    for rank in ranks:
        assert rank["ray_ids"] == rank["ids"] and len(rank["ids"]) == STEPS
        assert all(ranks[peer]["ids"] == rank["ids"] and ranks[peer]["losses"] == rank["losses"]
                   for peer in rank["tp_peers"])
    for step in range(STEPS):
        rows = [i for group in groups for i in ranks[group[0]]["ids"][step]]
        assert sorted(rows) == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)), (name, step)
        # the mean of the replicas' losses is the full batch's (equal shards); the
        # parameters it is taken at differ by reduction order only, as above
        mean = sum(ranks[group[0]]["losses"][step] for group in groups) / len(groups)
        assert mean == pytest.approx(want_losses[step], rel=ATOL), (name, step)


# --- drop-in: an ordinary TorchTrainer script, unchanged ---------------------

def _ordinary_loop(config):
    import os
    import tempfile

    import ray.train.torch
    from torch.utils.data import DataLoader, TensorDataset

    ctx = ray.train.get_context()
    model = ray.train.torch.prepare_model(nn.Linear(8, 1))
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"epoch": epoch, "loss": loss.item(), "world_size": ctx.get_world_size(),
                              "device": str(ray.train.torch.get_device())}, checkpoint=checkpoint)


def test_ordinary_torch_trainer_loop_runs_unchanged(sim, tmp_path):
    result = TPUTorchTrainer(
        _ordinary_loop,
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        run_config=ray.train.RunConfig(name="dropin", storage_path=str(tmp_path)),
    ).fit()
    assert result.error is None
    assert result.metrics["epoch"] == 1 and result.metrics["world_size"] == 4 and result.metrics["device"] == "tpu"
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        # saved from device tensors: the driver holds no TPU, so it maps them to the host (as with CUDA)
        with pytest.raises(RuntimeError, match="tpu"):
            torch.load(Path(d) / "model.pt")
        state = torch.load(Path(d) / "model.pt", map_location="cpu")
    assert set(state) == {"module.weight", "module.bias"}  # DDP-wrapped, as with TorchTrainer
    assert str(result.path).startswith(str(tmp_path / "dropin"))


def _slip_on_rank_2():
    import ray_train_tpu

    model = ray_train_tpu.prepare_model(nn.Linear(8, 1))
    batch = torch.randn(4, 8)  # never moved to the device
    if ray.train.get_context().get_world_rank() == 2:
        model(batch)
    model(batch.to(ray_train_tpu.get_device()))


def test_a_host_batch_fed_to_the_device_model_fails_as_on_a_tpu(sim, tmp_path):
    """The error of one rank is the run's TrainingFailedError, and it names both devices."""
    with pytest.raises(ray.train.TrainingFailedError, match=r"two devices, tpu:0 and cpu") as e:
        TPUTorchTrainer(
            _slip_on_rank_2,
            scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
            run_config=ray.train.RunConfig(storage_path=str(tmp_path)),
        ).fit()


# --- Hugging Face Trainer: Ray's prepare_trainer + RayTrainReportCallback recipe -----

# Save (and evaluate) every step; rank 1 dies at the end of step 2, before that step's save,
# once step 1's checkpoint is committed: the restarted group resumes at step 1.
HF_STEPS, HF_KILL_AT = 2, 2


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))


def _hf_rows(n):
    ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(1)).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]


def _hf_loop(config):
    """Ray's own HF recipe (ray/train/v2/tests/test_torch_transformers_train.py, and Ray's
    "Get started with Hugging Face Transformers" guide), in TPUTorchTrainer, with
    ray_train_tpu.huggingface.prepare_trainer in place of Ray's (accelerate has no
    distributed type for TorchTPU: it averages the gradients): training rows from a Ray
    Data shard, evaluation rows from a datasets.Dataset, bf16, gradient checkpointing,
    eval and save every step; rank 1 dies once, and the run resumes from Ray Train's
    latest checkpoint."""
    import os
    import time

    import datasets
    import psutil
    from accelerate.state import AcceleratorState
    from ray.train.huggingface.transformers import RayTrainReportCallback
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ray_train_tpu.huggingface import prepare_trainer

    rank = ray.train.get_context().get_world_rank()
    out = Path(config["out"])

    class Probe(TrainerCallback):
        started = False

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if self.started:
                return
            self.started = True
            with open(out / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"start_step": state.global_step, "device": str(args.device),
                                    "param_device": str(next(model.parameters()).device),
                                    "mixed_precision": str(AcceleratorState().mixed_precision),
                                    "checkpointing": model.is_gradient_checkpointing,
                                    # where the time goes (not asserted): process start, first step
                                    "process_start_s": psutil.Process().create_time(), "first_step_s": time.time()})
                        + "\n")

        def on_step_end(self, args, state, control, **kwargs):
            marker = out / "killed"
            if rank == 1 and state.global_step == HF_KILL_AT and not marker.exists():
                # Ray Train commits a checkpoint once every rank's report has reached its
                # controller (polled every 2 s): wait for that, as a real failure would
                # have to come after it for this checkpoint to count
                committed = ray.train.get_all_reported_checkpoints()
                marker.write_text(json.dumps([c.metrics["step"] for c in committed]))
                (out / "killed_at").write_text(str(time.time()))
                os._exit(1)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            (out / f"rank{rank}.final").write_text(json.dumps(
                {"params": [p.detach().cpu().double().sum().item() for p in model.parameters()],
                 "output_dir": args.output_dir, "end_s": time.time()}))

    args = TrainingArguments(
        output_dir=str(out / "hf"), max_steps=HF_STEPS, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        bf16=True, gradient_checkpointing=True, eval_strategy="steps", eval_steps=1, save_strategy="steps",
        save_steps=1, logging_steps=1, report_to=[], disable_tqdm=True, learning_rate=1e-3,
    )
    shard = ray.train.get_dataset_shard("train")
    if ray.train.get_checkpoint() is None:  # one epoch over this rank's shard, to check the sharding
        rows = [row for batch in shard.iter_torch_batches(batch_size=4) for row in batch["input_ids"].tolist()]
        (out / f"rank{rank}.rows").write_text(json.dumps(rows))
    trainer = Trainer(
        model=_tiny_llama(), args=args,
        train_dataset=shard.iter_torch_batches(batch_size=2),
        eval_dataset=datasets.Dataset.from_list(_hf_rows(8)),
        callbacks=[RayTrainReportCallback(), Probe()],
    )
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.train()
    else:
        with checkpoint.as_directory() as d:
            trainer.train(resume_from_checkpoint=os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))


def test_hugging_face_trainer_trains_on_the_device_reports_and_resumes_after_a_worker_dies(sim, tmp_path):
    from ray_train_tpu.progress import TrainingProgress

    out = tmp_path / "hf_out"
    out.mkdir()
    progress = TrainingProgress(total=HF_STEPS, poll_s=0.2)
    (out / "fit_start").write_text(str(__import__("time").time()))
    result = progress.fit(TPUTorchTrainer(
        _hf_loop,
        train_loop_config={"out": str(out)},
        datasets={"train": ray.data.from_items(_hf_rows(16))},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        run_config=ray.train.RunConfig(name="hf", storage_path=str(tmp_path / "storage"), callbacks=[progress],
                                       failure_config=ray.train.FailureConfig(max_failures=1)),
    ))
    assert result.error is None, result.error
    # the progress bar's records carry each chip's memory, read in the workers (no code in _hf_loop):
    # at least the model's parameters, gradients and Adam moments on every rank, of v4's 32 GiB
    last = progress.history[-1]
    assert last["step"] == HF_STEPS and sorted(last["device_memory"]) == [0, 1, 2, 3]
    state_bytes = 4 * 4 * sum(p.numel() for p in _tiny_llama().parameters())
    assert all(m["peak_bytes"] >= state_bytes for m in last["device_memory"].values()), last["device_memory"]
    assert last["device_total_bytes"] == 32 * 2**30
    # Ray Data shards: every rank holds rows, no row twice, together the dataset
    shards = [json.loads((out / f"rank{r}.rows").read_text()) for r in range(4)]
    assert all(shards) and sorted(row for rows in shards for row in rows) == sorted(r["input_ids"] for r in _hf_rows(16))
    assert json.loads((out / "killed").read_text()) == [1]  # step 1's checkpoint was committed when rank 1 died
    starts = {r: [json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(4)}
    for r, runs in starts.items():
        assert [run["start_step"] for run in runs] == [0, 1], (r, runs)  # the restart resumed at step 1
        assert all(run["device"] == "tpu:0" and run["param_device"] == "tpu:0" and run["checkpointing"]
                   and run["mixed_precision"] == "bf16" for run in runs), (r, runs)
    assert result.metrics["step"] == HF_STEPS and "eval_loss" in result.metrics and "loss" in result.metrics
    with result.checkpoint.as_directory() as d:
        state = json.loads((Path(d) / "checkpoint" / "trainer_state.json").read_text())
    assert state["global_step"] == HF_STEPS
    # data parallel: ranks read different shards, yet end with the same parameters;
    # rank 0 alone wrote into output_dir (the others into rank<k>/ below it)
    finals = [json.loads((out / f"rank{r}.final").read_text()) for r in range(4)]
    assert all(f["params"] == finals[0]["params"] for f in finals), [f["params"][:2] for f in finals]
    assert [Path(f["output_dir"]).name for f in finals] == ["hf", "rank1", "rank2", "rank3"]
    # the resumed run's log continues step 1's: one training loss per step, none repeated
    assert [log["step"] for log in state["log_history"] if "loss" in log] == [1, 2]
