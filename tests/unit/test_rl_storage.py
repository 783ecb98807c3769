"""Where GRPO checkpoints go (`ray_train_tpu.rl.storage`): shared storage as Ray
Train's ``storage_path`` names it, the refusal of a driver-local default on a
multi-node cluster, the per-host check of model and checkpoint directories, and
the simulated hosts' own disks (`simulated_cluster.host_sees`)."""

import os
import tempfile

import pytest
import torch

from ray_train_tpu import constants as C
from ray_train_tpu.rl import storage
from ray_train_tpu.testing.simulated_cluster import host_sees


def _remote_fs():
    """A pyarrow filesystem that is not pyarrow's LocalFileSystem (as gs:// or s3:// are
    not), over this machine's disk, so that the upload/download path runs here."""
    import pyarrow.fs
    from fsspec.implementations.local import LocalFileSystem

    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(LocalFileSystem()))


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_ray_train_storage_helpers_resolve_a_uri_and_a_path_as_storage_path_does():
    import pyarrow.fs

    from ray_train_tpu._compat import ray_train as compat_ray

    fs, path = compat_ray.storage_fs_and_path("mock:///bucket/run")
    assert isinstance(fs, pyarrow.fs.FileSystem) and path == "bucket/run"
    assert storage.resolve("/mnt/shared/run") == (None, "/mnt/shared/run")
    assert storage.resolve("file:///mnt/shared/run") == (None, "/mnt/shared/run")  # pyarrow's local fs: a path
    fs, path = storage.resolve("mock:///bucket/run")
    assert fs is not None and path == "bucket/run"


def test_a_uri_checkpoint_is_staged_on_the_host_uploaded_manifest_last_and_loaded_back(tmp_path, monkeypatch):
    fs, root = _remote_fs(), str(tmp_path / "bucket" / "run")
    host_tmp = tmp_path / "host_tmp"
    host_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(host_tmp))  # this host's own scratch
    model, opt = _model_and_optimizer(0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    storage.save(root, "step_000005", model=model, optimizer=opt, step=5, filesystem=fs)
    later, later_opt = _model_and_optimizer(1)
    storage.save(root, "step_000010", model=later, optimizer=later_opt, step=10, filesystem=fs)
    assert not [f for f in os.listdir(host_tmp) if f.startswith("grpo_ckpt_")]  # staged here, then removed
    assert "manifest.json" in os.listdir(os.path.join(root, "step_000010"))
    assert storage.latest(root, filesystem=fs) == f"{root}/step_000010"
    # An upload cut short (no manifest yet, or a short shard) is not a checkpoint.
    os.remove(os.path.join(root, "step_000010", "manifest.json"))
    assert storage.latest(root, filesystem=fs) == f"{root}/step_000005"
    shard = next(f for f in os.listdir(os.path.join(root, "step_000005")) if f.endswith(".distcp"))
    with open(os.path.join(root, "step_000005", shard), "r+b") as f:
        f.truncate(1)
    assert storage.latest(root, filesystem=fs) is None
    storage.save(root, "step_000015", model=model, optimizer=opt, step=15, filesystem=fs)
    fresh, fresh_opt = _model_and_optimizer(2)
    assert storage.load(storage.latest(root, filesystem=fs), model=fresh, optimizer=fresh_opt, filesystem=fs) == 15
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert not [f for f in os.listdir(host_tmp) if f.startswith("grpo_ckpt_")]


def test_a_driver_local_default_is_refused_on_a_multi_node_cluster_by_name():
    storage.refuse_driver_local_default(None, 1)  # one node: the driver's disk is the hosts' disk
    storage.refuse_driver_local_default("gs://b/run", 5)
    with pytest.raises(ValueError) as e:
        storage.refuse_driver_local_default(None, 3)
    msg = str(e.value)
    assert "GRPOConfig(checkpoint_dir=None)" in msg and "3 nodes" in msg and "step 0" in msg  # field, value, rule
    assert "gs://" in msg and "storage_path" in msg  # the fix


def test_the_loop_refuses_it_before_anything_starts(tmp_path, monkeypatch):
    import ray

    from ray_train_tpu.rl import GRPOConfig, GRPOLoop, addition_records, strict_answer_reward, tiny_addition_model

    config = GRPOConfig(model_dir=tiny_addition_model(str(tmp_path)), prompts=addition_records(4),
                        reward_fn=strict_answer_reward)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}] * 3)
    loop = GRPOLoop(config)
    monkeypatch.setattr(loop, "_reserve", lambda: pytest.fail("reserved slices before refusing"))
    with pytest.raises(ValueError, match=r"checkpoint_dir=None.*3 nodes"):
        with loop:
            pass
    assert not loop.checkpoint_root.exists()  # the empty temporary directory is not left behind


def test_a_simulated_host_sees_its_own_disk_and_shared_storage_not_another_hosts(tmp_path):
    hosts = tmp_path / "hosts"
    a, b = hosts / "127.0.1.1", hosts / "127.0.1.2"
    assert host_sees(str(a / "tmp" / "x"), str(a)) and host_sees(str(tmp_path / "shared" / "x"), str(a))
    assert not host_sees(str(b / "tmp" / "x"), str(a)) and not host_sees(str(hosts / "127.0.0.100" / "m"), str(a))
    assert host_sees(str(b / "tmp" / "x"), None)  # not a simulated host


def test_host_check_reports_a_model_or_checkpoint_dir_on_another_hosts_disk(tmp_path, monkeypatch):
    import ray.util

    from ray_train_tpu.rl.models import tiny_addition_model

    hosts = tmp_path / "hosts"
    shared_model = tiny_addition_model(str(tmp_path / "shared"))
    other_model = tiny_addition_model(str(hosts / "127.0.0.100" / "tmp"))  # made on the driver's disk
    marker = hosts / "127.0.0.100" / "tmp" / "marker"
    marker.write_text("x")
    monkeypatch.setenv(C.RAY_TRAIN_TPU_SIMULATE_HOST_ROOT, str(hosts / "127.0.1.1"))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.1.1")
    assert storage.host_check(shared_model, None)["model_dir"] is True
    report = storage.host_check(other_model, str(marker))
    assert report["model_dir"] is False and report["checkpoint_dir"] is False and report["ip"] == "127.0.1.1"
    monkeypatch.delenv(C.RAY_TRAIN_TPU_SIMULATE_HOST_ROOT)  # not simulated: the machine's disk is the host's
    assert storage.host_check(other_model, str(marker))["checkpoint_dir"] is True
    assert storage.host_check(str(tmp_path / "missing"), None)["model_dir"] is False


def test_grpo_config_checkpoint_dir_is_a_path_or_uri(tmp_path):
    from ray_train_tpu.rl import GRPOConfig, strict_answer_reward

    base = dict(model_dir=str(tmp_path), prompts=[{"prompt": "1+1="}], reward_fn=strict_answer_reward)
    assert GRPOConfig(**base, checkpoint_dir=tmp_path / "c").checkpoint_dir == str(tmp_path / "c")
    with pytest.raises(TypeError, match="checkpoint_dir"):
        GRPOConfig(**base, checkpoint_dir="")
