"""ray_train_tpu.checkpoint: exact round trips, resharding, and refusing bad checkpoints.

Multi-rank cases run as 2 gloo processes (ray_train_tpu.testing.gloo) of a
simulated TPU host: models and batches on the simulated "tpu" device, whose
random-number generator (dropout) is its own, as on a TPU. A failed assertion
in either fails the test with that process's traceback.
"""

import json
import logging
import shutil
from pathlib import Path

from ray_train_tpu.testing import gloo as _spawn
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ray_train_tpu import checkpoint
from ray_train_tpu.checkpoint import CheckpointError, CheckpointNotFoundError
from ray_train_tpu.data import stateful_dataloader
from ray_train_tpu.device import get_device

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _net(hidden=8):
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 2))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 2, generator=g))


def _parts(model, rank=None, world=None):
    """Optimizer, scheduler and loader for ``model`` (already seeded / wrapped)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    kw = {} if rank is None else dict(rank=rank, world_size=world)
    loader = stateful_dataloader(_data(), batch_size=4, seed=11, **kw)
    return opt, sched, loader


def _batches(loader):
    epoch = loader.epoch
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _train(model, opt, sched, batches, steps):
    losses = []
    device = next(model.parameters()).device
    for _ in range(steps):
        x, y = (t.to(device) for t in next(batches))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _full_state(model, opt):
    return get_model_state_dict(model, options=FULL), get_optimizer_state_dict(model, opt, options=FULL)


def _assert_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), (where, list(a), list(b))
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _on_two_ranks(fn, tmp_path):
    _spawn.run(fn, 2, str(tmp_path), timeout_s=180, simulate_tpu=True)


def _ddp(seed=0, hidden=8):
    torch.manual_seed(seed)
    return nn.parallel.DistributedDataParallel(_net(hidden).to(get_device()))


# ---------------------------------------------------------------- 2 ranks, DDP


def _roundtrip_worker(rank, world, tmp):
    tmp = Path(tmp)
    model = _ddp()
    opt, sched, loader = _parts(model)
    torch.manual_seed(1000 + rank)  # dropout differs per rank; restored per rank
    batches = _batches(loader)
    _train(model, opt, sched, batches, 8)  # 6 batches per epoch: into epoch 1
    info = checkpoint.save(tmp / "a", model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader,
                           step=8, extra={"epoch": loader.epoch})
    assert info.step == 8 and info.world_size == 2
    pending = checkpoint.save(tmp / "b", model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader,
                              step=8, async_save=True)
    reference = _train(model, opt, sched, batches, 5)  # changes the parameters while "b" is written
    assert pending.result().step == 8
    expected = _full_state(model, opt)
    for name in ("a", "b"):
        model2 = _ddp(seed=99)
        opt2, sched2, loader2 = _parts(model2)
        torch.manual_seed(7)  # replaced by the checkpoint's RNG state
        got = checkpoint.load(tmp / name, model=model2, optimizer=opt2, lr_scheduler=sched2, dataloader=loader2)
        assert (got.step, got.world_size) == (8, 2)
        assert _train(model2, opt2, sched2, _batches(loader2), 5) == reference, name
        _assert_equal(_full_state(model2, opt2), expected, name)
    if rank == 0:
        manifest = json.loads((tmp / "a" / checkpoint.MANIFEST).read_text())
        assert manifest["extra"] == {"epoch": 1} and manifest["step"] == 8
        assert {"rank00000.pt", "rank00001.pt", ".metadata"} <= set(manifest["files"])
        assert manifest["components"] == ["dataloader", "lr_scheduler", "model", "optimizer", "rng"]
    with_other_model = _ddp(hidden=9)
    try:
        checkpoint.load(tmp / "a", model=with_other_model)
        raise AssertionError("loaded into another model")
    except CheckpointError as e:
        assert "'0.weight' is [8, 6] torch.float32 in the checkpoint and [9, 6] torch.float32 in the model" in str(e)
    _report_and_restore(rank, tmp, model, opt, sched, loader)


def _report_and_restore(rank, tmp, model, opt, sched, loader):
    """`report` hands each rank's directory to ray.train.report, which (like Ray
    Train) copies every rank's files into one directory."""
    import ray.train

    reported = []

    def fake_report(metrics, checkpoint=None):
        merged = tmp / "storage" / f"checkpoint_{len(reported)}"
        merged.mkdir(parents=True, exist_ok=True)
        shutil.copytree(checkpoint.path, merged, dirs_exist_ok=True)
        reported.append((metrics, merged))

    ray.train.report = fake_report
    ray.train.get_checkpoint = lambda: ray.train.Checkpoint.from_directory(str(reported[-1][1]))
    checkpoint.report({"loss": 1.0}, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader, step=20)
    assert len(reported) == 1
    checkpoint.report({"loss": 2.0}, model=model, optimizer=opt, dataloader=loader, step=21, async_save=True)
    assert len(reported) == 1  # reported once the files are complete
    assert checkpoint.wait().step == 21 and [m for m, _ in reported] == [{"loss": 1.0}, {"loss": 2.0}]
    dist.barrier()
    files = {p.name for p in reported[0][1].iterdir()}
    assert {"manifest.json", ".metadata", "rank00000.pt", "rank00001.pt", "__0_0.distcp"} <= files, files
    model2 = _ddp(seed=5)
    opt2, _, loader2 = _parts(model2)
    assert checkpoint.restore(model=model2, optimizer=opt2, dataloader=loader2).step == 21
    _assert_equal(_full_state(model2, opt2), _full_state(model, opt), "restored")


def test_ddp_save_load_resumes_bitwise_sync_async_and_through_report(tmp_path):
    _on_two_ranks(_roundtrip_worker, tmp_path)


# ---------------------------------------------------------------- resharding


def _reshard_worker(rank, world, tmp):
    from torch.distributed.fsdp import fully_shard

    tmp = Path(tmp)
    model = _ddp()
    opt, sched, loader = _parts(model)
    _train(model, opt, sched, _batches(loader), 3)
    checkpoint.save(tmp / "ddp", model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader, step=3)
    expected = _full_state(model, opt)
    if rank == 0:
        torch.save(expected, tmp / "ddp_full.pt")
    torch.manual_seed(42)
    sharded = _net().to(get_device())
    for layer in (sharded[0], sharded[3]):
        fully_shard(layer)
    fully_shard(sharded)
    opt2, sched2, loader2 = _parts(sharded)
    info = checkpoint.load(tmp / "ddp", model=sharded, optimizer=opt2, lr_scheduler=sched2, dataloader=loader2)
    assert info.step == 3
    assert type(sharded[0].weight).__name__ == "DTensor"
    _assert_equal(_full_state(sharded, opt2), expected, "ddp->fsdp2")
    assert sched2.state_dict() == sched.state_dict()
    _train(sharded, opt2, sched2, _batches(loader2), 2)
    checkpoint.save(tmp / "fsdp", model=sharded, optimizer=opt2, step=5)
    full = _full_state(sharded, opt2)  # a collective: every rank
    if rank == 0:
        torch.save(full, tmp / "fsdp_full.pt")
    _reshard_across_slices(rank, tmp)


def _reshard_across_slices(rank, tmp):
    """HSDP over 2 "slices" of one rank -> FSDP2 on one slice of 2 ranks (and, in the
    test, one process); TP within a slice of 2 ranks -> one process (in the test)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ray_train_tpu.strategies import FSDP2Strategy, TensorParallelStrategy

    device = get_device()

    def built(strategy, num_slices, seed):
        strategy.setup(device, world_size=2, num_slices=num_slices)
        torch.manual_seed(seed)
        model = strategy.parallelize(_net(), device)
        return model, *_parts(model)

    hsdp = FSDP2Strategy()
    model, opt, sched, loader = built(hsdp, num_slices=2, seed=1)
    assert hsdp.device_mesh.mesh_dim_names[:2] == ("dp_replicate", "dp_shard") and hsdp.device_mesh.shape[:2] == (2, 1)
    _train(model, opt, sched, _batches(loader), 3)
    checkpoint.save(tmp / "hsdp", model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader, step=3)
    expected = _full_state(model, opt)
    one_slice, opt2, sched2, loader2 = built(FSDP2Strategy(), num_slices=1, seed=2)
    checkpoint.load(tmp / "hsdp", model=one_slice, optimizer=opt2, lr_scheduler=sched2, dataloader=loader2)
    _assert_equal(_full_state(one_slice, opt2), expected, "hsdp 2 slices -> fsdp2 1 slice")
    tp = TensorParallelStrategy(plan={"0": ColwiseParallel(), "3": RowwiseParallel()})
    model, opt, sched, _ = built(tp, num_slices=1, seed=3)
    _train(model, opt, sched, _batches(_parts(_net(), rank=0, world=1)[2]), 2)  # every TP rank reads the same batch
    checkpoint.save(tmp / "tp", model=model, optimizer=opt, step=2)
    full_tp = _full_state(model, opt)
    if rank == 0:
        torch.save(expected, tmp / "hsdp_full.pt")
        torch.save(full_tp, tmp / "tp_full.pt")


def test_checkpoints_reshard_across_strategies_ranks_and_slices(tmp_path, caplog):
    """DDP -> FSDP2; HSDP on 2 slices -> FSDP2 on 1 slice; every one of them, and TP,
    into one process; the data loader resumes the epoch re-sharded."""
    _on_two_ranks(_reshard_worker, tmp_path)
    for name in ("ddp", "fsdp", "hsdp", "tp"):
        model = _net()
        opt, sched, loader = _parts(model, rank=0, world=1)
        with caplog.at_level(logging.WARNING, logger="ray_train_tpu.checkpoint"):
            info = checkpoint.load(tmp_path / name, model=model, optimizer=opt)
        assert info.world_size == 2 and "RNG state not restored" in caplog.text
        _assert_equal(_full_state(model, opt), torch.load(tmp_path / f"{name}_full.pt"), name)
    # 2 ranks read 3 batches of 4: one process resumes the epoch at sample 24 of its order.
    checkpoint.load(tmp_path / "ddp", model=model, dataloader=loader)
    loader.set_epoch(loader.epoch)
    order = torch.utils.data.DistributedSampler(_data(), num_replicas=1, rank=0, shuffle=True, seed=11)
    order.set_epoch(0)
    assert torch.equal(torch.cat([x for x, _ in loader]), _data().tensors[0][list(order)[24:]])
    with pytest.raises(CheckpointError, match=r"has no lr_scheduler state .*pass lr_scheduler=None"):
        checkpoint.load(tmp_path / "fsdp", model=model, lr_scheduler=sched)


# ---------------------------------------------------------------- refusing bad checkpoints


@pytest.fixture
def two_steps(tmp_path):
    """root/step_1 and root/step_2, both complete, from one process."""
    torch.manual_seed(0)
    model = _net()
    opt, sched, loader = _parts(model, rank=0, world=1)
    batches = _batches(loader)
    for step in (1, 2):
        _train(model, opt, sched, batches, 1)
        checkpoint.save(tmp_path / f"step_{step}", model=model, optimizer=opt, dataloader=loader, step=step)
    return tmp_path, model, opt


def _damage(directory: Path, how: str) -> str:
    manifest = json.loads((directory / checkpoint.MANIFEST).read_text())
    shard = next(n for n in manifest["files"] if n.endswith(".distcp"))
    if how == "no manifest":
        (directory / checkpoint.MANIFEST).unlink()
        return checkpoint.MANIFEST
    if how == "bad manifest":
        (directory / checkpoint.MANIFEST).write_text("{not json")
        return checkpoint.MANIFEST
    if how == "truncated shard":
        path = directory / shard
        path.write_bytes(path.read_bytes()[:-10])
        return shard
    if how == "missing rank file":
        (directory / "rank00000.pt").unlink()
        return "rank00000.pt"
    data = bytearray((directory / "rank00000.pt").read_bytes())  # "corrupt rank file"
    data[len(data) // 2] ^= 0xFF
    (directory / "rank00000.pt").write_bytes(bytes(data))
    return "rank00000.pt"


@pytest.mark.parametrize(
    "how, error, rule",
    [
        ("no manifest", CheckpointNotFoundError, "not a complete ray_train_tpu checkpoint"),
        ("bad manifest", CheckpointError, "is not a valid manifest"),
        ("truncated shard", CheckpointError, "the manifest of step 2 says .* truncated"),
        ("missing rank file", CheckpointNotFoundError, "listed in the manifest of step 2.* is missing"),
        ("corrupt rank file", CheckpointError, "crc32 .* the file is corrupt"),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_file_and_the_previous_one_is_kept(two_steps, how, error, rule):
    root, model, opt = two_steps
    name = _damage(root / "step_2", how)
    before = _full_state(model, opt)
    with pytest.raises(error, match=rule) as e:
        checkpoint.load(root / "step_2", model=model, optimizer=opt)
    assert str(root / "step_2" / name) in str(e.value)
    _assert_equal(_full_state(model, opt), before, "untouched by a refused load")
    assert checkpoint.latest_checkpoint(root) == root / "step_1"
    assert checkpoint.load(root / "step_1", model=model, optimizer=opt).step == 1


def test_not_found_is_also_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json not found"):
        checkpoint.load(tmp_path / "nothing", model=_net())
    assert checkpoint.latest_checkpoint(tmp_path / "nothing") is None


def test_checkpoint_of_another_model_or_optimizer_is_refused(two_steps):
    root, _, _ = two_steps
    with pytest.raises(CheckpointError, match=r"another model: '0.bias' is \[8\] torch.float32 in the checkpoint and \[16"):
        checkpoint.load(root / "step_2", model=_net(hidden=16))
    renamed = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(CheckpointError, match=r"'3.bias' is in the checkpoint but not in the model"):
        checkpoint.load(root / "step_2", model=renamed)
    model = _net()
    with pytest.raises(CheckpointError, match=r"optimizer \{'class': 'AdamW'.*not of \{'class': 'SGD'"):
        checkpoint.load(root / "step_2", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    model = _net().to(torch.float64)
    with pytest.raises(CheckpointError, match=r"torch.float32 in the checkpoint and \[8, 6\] torch.float64"):
        checkpoint.load(root / "step_2", model=model)


def test_save_never_overwrites_a_complete_checkpoint(two_steps):
    root, model, opt = two_steps
    before = (root / "step_2" / checkpoint.MANIFEST).read_bytes()
    with pytest.raises(CheckpointError, match="already holds a complete checkpoint.*new directory"):
        checkpoint.save(root / "step_2", model=model, step=3)
    assert (root / "step_2" / checkpoint.MANIFEST).read_bytes() == before
    assert checkpoint.load(root / "step_2", model=model, optimizer=opt).step == 2


def test_interrupted_save_leaves_no_manifest(two_steps, monkeypatch):
    root, model, opt = two_steps
    from ray_train_tpu.checkpoint import writer

    monkeypatch.setattr(writer, "_write_manifest", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(root / "step_3", model=model, optimizer=opt, step=3)
    assert any((root / "step_3").iterdir()) and not (root / "step_3" / checkpoint.MANIFEST).exists()
    assert checkpoint.latest_checkpoint(root) == root / "step_2"


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(step=-1), ValueError, r"step=-1\) must be an integer >= 0"),
        (dict(step=1, extra={"t": torch.ones(1)}), TypeError, "JSON-serialisable"),
    ],
)
def test_bad_save_arguments(tmp_path, kw, error, match):
    with pytest.raises(error, match=match):
        checkpoint.save(tmp_path / "x", model=_net(), **kw)


def test_fingerprint_ignores_the_wrapper():
    model = _net()
    fp = checkpoint.fingerprint(model)
    assert fp[0] == ["0.bias", [8], "torch.float32"]
    assert checkpoint.fingerprint(torch.compile(model)) == fp


def test_a_checkpoint_never_starts_the_accelerator_for_its_random_state(monkeypatch):
    """In a process that imported torch_tpu but never used a chip (a driver on a
    TPU host), saving must not start the device: that opens the chips and holds
    libtpu's lockfile against the workers. Once started, its state is saved."""
    from ray_train_tpu.checkpoint import writer

    calls = []

    class FakeTPU:
        started = False

        @classmethod
        def is_initialized(cls):
            return cls.started

        @staticmethod
        def get_rng_state():
            calls.append("get")
            return torch.zeros(2, dtype=torch.uint8)

        @staticmethod
        def set_rng_state(state):
            calls.append("set")

    # (the test process has no "tpu" device type: PrivateUse1 stands for it)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("privateuseone"))
    monkeypatch.setattr(torch, "get_device_module", lambda t: FakeTPU)
    assert "accelerator" not in writer._rng_state() and calls == []
    FakeTPU.started = True
    assert writer._rng_state()["accelerator"][0] == "privateuseone" and calls == ["get"]
