"""The simulated TPU device: not the host, as strict as a real chip where it matters.

Every case runs in a spawned process of a simulated TPU host
(`ray_train_tpu.testing.gloo.run(..., simulate_tpu=True)`): registering the
device renames PyTorch's PrivateUse1 slot for the life of a process, which the
test process itself must never do. The checks that run there return plain
values; a failed assertion fails the test with the child's traceback.
"""

import pickle

import pytest
import torch

from ray_train_tpu.testing import gloo as _spawn


def _in_child(fn, world_size=1):
    return _spawn.run(fn, world_size, timeout_s=120, simulate_tpu=True)


def _single_rank_checks(rank, world):
    return {name: fn(rank, world) for name, fn in (("mixing", _mixing_fails), ("copies", _host_device_copies),
                                                   ("rng", _own_generator), ("pickle", _pickles_to_the_device),
                                                   ("in_place", _in_place_metadata), ("ties", _tied_weights),
                                                   ("load", _loads_onto_the_device),
                                                   ("memory", _accelerator_memory_of_the_chip),
                                                   ("adamw", _chip_memory_after_adamw))}


@pytest.fixture(scope="module")
def checked():
    """One simulated process runs every single-rank check (a spawn costs ~2 s)."""
    return _in_child(_single_rank_checks)[0]


def _mixing_fails(rank, world):
    from torch import nn

    import ray_train_tpu
    from ray_train_tpu._compat.simulated_tpu import DeviceMismatchError

    device = ray_train_tpu.get_device()
    assert device == torch.device("tpu") and str(device) == "tpu"
    model = nn.Linear(4, 2).to(device)
    assert model.weight.device == torch.device("tpu", 0) and model.weight.device.type == "tpu"
    host = torch.randn(3, 4)
    messages = []
    for slip in (lambda: model(host), lambda: host + model.weight[:1], lambda: torch.cat([host, model.weight.T.T[:1]]),
                 lambda: torch.nn.functional.mse_loss(model(host.to(device)), torch.zeros(3, 2))):
        try:
            slip()
        except DeviceMismatchError as e:
            messages.append(str(e))
    assert len(messages) == 4, messages
    assert all("found at least two devices, tpu:0 and cpu" in m for m in messages), messages
    # what is allowed, as on CUDA: copies, 0-dim host scalars, host index tensors
    x = host.to(device)
    y = x * torch.tensor(2.0) + 1
    assert y.device.type == "tpu" and torch.equal(y.cpu(), host * 2 + 1)
    assert torch.equal(x[torch.tensor([0, 2])].cpu(), host[[0, 2]])
    assert model(x).device.type == "tpu" and model(x).cpu().device.type == "cpu"
    return messages[0]


def test_a_host_tensor_meeting_a_device_tensor_fails_naming_both_devices(checked):
    message = checked["mixing"]
    assert "SIMULATED TPU device" in message and ".to(ray_train_tpu.get_device())" in message


def _host_device_copies(rank, world):
    import ray_train_tpu

    device = ray_train_tpu.get_device()
    host = torch.arange(6, dtype=torch.float32).view(2, 3)
    on_device = host.to(device)
    assert type(on_device).__name__ == "SimulatedTPUTensor" and not on_device.is_cpu
    back = on_device.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, host)
    host.add_(100)  # a copy, not an alias of the host tensor
    assert torch.equal(on_device.cpu(), back)
    made = [torch.zeros(2, device=device), torch.ones(2, 2, device="tpu"), torch.arange(3, device=device),
            torch.tensor([1, 2], device=device), torch.empty_like(on_device), on_device.new_zeros(4),
            on_device.to(torch.bfloat16), on_device.T.contiguous(), on_device.sum()]
    assert all(t.device == torch.device("tpu", 0) for t in made)
    scalars = (on_device.sum().item(), float(on_device.max()), f"{on_device.mean():.2f}", on_device.tolist())
    try:
        on_device.numpy()
        raise AssertionError(".numpy() of a device tensor worked")
    except TypeError as e:
        numpy_error = str(e)
    return scalars, numpy_error, repr(on_device)


def test_copies_between_host_and_device_are_explicit_and_scalars_come_back(checked):
    ((total, largest, mean, listed), numpy_error, shown) = checked["copies"]
    assert (total, largest, mean, listed) == (15.0, 5.0, "2.50", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    assert "can't convert tpu:0 device type tensor to numpy" in numpy_error
    assert shown.endswith("device='tpu:0')")


def _tied_weights(rank, world):
    """As with torch_tpu's tensors, a host parameter cannot take a device tensor
    in place, so Module.to makes one parameter per module; our move re-ties."""
    import ray_train_tpu
    from ray_train_tpu.strategies.base import to_device

    def tied():
        embed, head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
        head.weight = embed.weight
        return torch.nn.Sequential(embed, head)

    device = ray_train_tpu.get_device()
    plain, ours = tied().to(device), to_device(tied(), device)
    return plain[1].weight is plain[0].weight, ours[1].weight is ours[0].weight, len(list(ours.parameters()))


def test_moving_a_model_to_the_device_keeps_tied_weights_tied(checked):
    plain_tied, ours_tied, num_params = checked["ties"]
    assert not plain_tied  # what a "tpu" tensor does to Module.to (torch_tpu's trainer re-ties too)
    assert ours_tied and num_params == 1


def _own_generator(rank, world):
    import ray_train_tpu

    device = ray_train_tpu.get_device()
    torch.manual_seed(0)
    host, dev = torch.randn(8), torch.randn(8, device=device).cpu()
    torch.manual_seed(0)
    again = torch.randn(8, device=device).cpu()
    dropped = torch.nn.functional.dropout(torch.ones(64, device=device), 0.5).cpu()
    module = torch.get_device_module("tpu")
    state = module.get_rng_state()
    first = torch.rand(4, device=device).cpu()
    module.set_rng_state(state)
    replay = torch.rand(4, device=device).cpu()
    host_before = torch.get_rng_state()
    torch.rand(4, device=device)  # a device draw leaves the host stream alone
    try:
        torch.randn(2, device=device, generator=torch.Generator().manual_seed(1))
        raise AssertionError("a host generator drove a device op")
    except RuntimeError as e:
        assert "generator of device 'cpu'" in str(e)
    return (torch.equal(host, dev), torch.equal(dev, again), 0 < int((dropped == 0).sum()) < 64,
            torch.equal(first, replay), torch.equal(host_before, torch.get_rng_state()))


def test_the_device_has_its_own_random_generator_seeded_by_torch_manual_seed(checked):
    same_as_host, reproducible, dropout_random, replayable, host_untouched = checked["rng"]
    assert not same_as_host and reproducible and dropout_random and replayable and host_untouched


def _returns_a_device_tensor(rank, world):
    import ray_train_tpu

    return {"loss": torch.ones(2, device=ray_train_tpu.get_device())}


def test_a_device_tensor_cannot_be_rebuilt_in_a_process_without_the_device():
    """A device tensor that leaves the worker (here through torch.save, as Ray
    pickles a task's result) arrives as a device tensor: the receiving process,
    like a driver on a real slice, has no TPU to put it on."""
    with pytest.raises(RuntimeError, match="tpu"):
        _in_child(_returns_a_device_tensor)


def _pickles_to_the_device(rank, world):
    import ray_train_tpu

    t = torch.arange(4.0, device=ray_train_tpu.get_device())
    back = pickle.loads(pickle.dumps(t))
    loaded = torch.load(__import__("io").BytesIO(_saved(t)), weights_only=True)
    mapped = torch.load(__import__("io").BytesIO(_saved(t)), weights_only=True, map_location="cpu")
    return [back.device.type, loaded.device.type, mapped.device.type, torch.equal(back.cpu(), mapped)]


def _saved(t):
    import io

    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def test_pickling_copies_to_the_host_and_rebuilds_on_the_device(checked):
    assert checked["pickle"] == ["tpu", "tpu", "cpu", True]


def _loads_onto_the_device(rank, world):
    """``torch.load(f, map_location="tpu:0")``, as the HF Trainer resumes optimizer state in a
    multi-process run (torch's own restore, ``storage.to("tpu:0")``, kills a Python backend's
    process with SIGSEGV)."""
    import io

    import ray_train_tpu
    from ray_train_tpu._compat.simulated_tpu_runtime import NotSimulatedError

    exp_avg = torch.arange(3.0)
    state = {"state": {0: {"exp_avg": exp_avg, "same": exp_avg}}, "step": torch.tensor(2.0),
             "device_saved": torch.arange(4.0, device=ray_train_tpu.get_device())}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    seen = []
    for location in ("tpu:0", torch.device("tpu", 0), "tpu"):
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=location, weights_only=True)
        seen.append([str(loaded["step"].device), str(loaded["state"][0]["exp_avg"].device),
                     str(loaded["device_saved"].device), loaded["state"][0]["exp_avg"] is loaded["state"][0]["same"],
                     torch.equal(loaded["state"][0]["exp_avg"].cpu(), exp_avg)])
    buffer.seek(0)
    try:
        torch.load(buffer, map_location={"cpu": "tpu:0"}, weights_only=True)
        refused = None
    except NotSimulatedError as e:
        refused = str(e)
    return seen, refused


def test_torch_load_with_map_location_tpu_puts_every_tensor_on_the_device(checked):
    seen, refused = checked["load"]
    assert seen == [["tpu:0", "tpu:0", "tpu:0", True, True]] * 3
    assert refused is not None and "map_location='tpu:0'" in refused


def _accelerator_memory_of_the_chip(rank, world):
    """What progress bars and benchmarks read per chip: torch.accelerator's statistics."""
    import os

    import ray_train_tpu
    from ray_train_tpu import device as device_mod
    from ray_train_tpu import topology

    device = ray_train_tpu.get_device()
    before = device_mod.accelerator_memory()
    t = torch.empty(4 * 2**20, dtype=torch.float32, device=device)  # 16 MiB
    during = device_mod.accelerator_memory()
    del t
    after = device_mod.accelerator_memory()
    os.environ["TPU_ACCELERATOR_TYPE"] = "v4-8"
    device_mod.describe_simulated_chip()
    gen, _ = topology.parse_pod_type("v4-8")
    return {"grew": during["allocated_bytes"] - before["allocated_bytes"],
            "peak_covers": during["peak_bytes"] >= during["allocated_bytes"],
            "freed": after["allocated_bytes"] == before["allocated_bytes"],
            "total_before": before.get("total_bytes"),
            "total": device_mod.accelerator_memory()["total_bytes"],
            "hbm_per_device": gen.hbm_bytes_per_chip // gen.devices_per_chip}


def test_accelerator_memory_reads_torch_accelerator_per_chip(checked):
    m = checked["memory"]
    assert m["grew"] == 16 * 2**20 and m["peak_covers"] and m["freed"]
    assert m["total_before"] is None  # no chip described: torch_tpu's answer for an unknown chip has no size
    assert m["total"] == m["hbm_per_device"] == 32 * 2**30  # v4: one device (megacore) of 32 GiB per chip


def test_accelerator_memory_is_empty_without_an_accelerator():
    from ray_train_tpu.device import accelerator_memory

    assert torch.accelerator.current_accelerator() is None  # the test process never simulates
    assert accelerator_memory() == {}


def _strategy_memory():
    from benchmarks import strategy_memory

    return strategy_memory


def _chip_memory_after_adamw(rank, world):
    import ray_train_tpu

    device = ray_train_tpu.get_device()
    before = _strategy_memory().chip_memory()["device_allocated_bytes"]  # what the other checks left alive
    torch.manual_seed(0)
    model = _strategy_memory().mlp(32, 64, 1).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32).to(device)).pow(2).mean().backward()
    opt.step()
    on_device = sum(t.numel() * t.element_size()
                    for t in [*model.parameters(), *(p.grad for p in model.parameters()),
                              *(v for s in opt.state.values() for v in s.values())]
                    if isinstance(t, torch.Tensor) and t.device.type == "tpu")
    chip = _strategy_memory().chip_memory()
    return {"counted": _strategy_memory().state_bytes(model, opt), "on_device": on_device,
            "allocated": chip["device_allocated_bytes"] - before, "chip": chip}


def test_strategy_memory_benchmarks_chip_figures_are_the_allocators_bytes_of_the_training_state(checked):
    """On the simulated device, torch.accelerator's allocated bytes after an AdamW step are
    the parameters, gradients and Adam moments the benchmark counts (AdamW's step counters
    stay on the host, as torch keeps them for a non-capturable optimizer)."""
    got = checked["adamw"]
    counted = got["counted"]
    params = counted["param_bytes"]
    assert got["allocated"] == got["on_device"] == 4 * params  # param, grad, exp_avg, exp_avg_sq
    assert counted["grad_bytes"] == params and counted["optimizer_bytes"] > 2 * params
    assert got["chip"]["device_peak_bytes"] >= got["chip"]["device_allocated_bytes"]


def _collectives(rank, world):
    import copy

    import torch.distributed as dist

    import ray_train_tpu

    device = ray_train_tpu.get_device()
    t = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(t)
    gathered = [torch.empty(1, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)], device=device))
    objects = [None] * world
    dist.all_gather_object(objects, "x" * (10 + 7 * rank))  # unequal sizes: resize_ on a device tensor
    _fsdp2_with_a_frozen_layer(device)
    tp_out = _tp_output_into_a_loss(device, world)
    model = torch.nn.Linear(2, 2).to(device)
    twin = copy.deepcopy(model)
    errors = []
    for slip in (lambda: dist.all_reduce(torch.ones(1)),  # a host tensor in the job's tpu_dist group
                 lambda: dist.all_reduce(torch.ones(1, device=device), group=dist.new_group(backend="gloo"))):
        try:
            slip()
        except RuntimeError as e:
            errors.append(str(e))
    return (dist.get_backend(), t.device.type, t.cpu().tolist(), [g.item() for g in gathered],
            [len(o) for o in objects], twin.weight.device.type, torch.equal(twin.weight.cpu(), model.weight.cpu()),
            isinstance(twin.weight, torch.nn.Parameter), errors, tp_out)


def _tp_output_into_a_loss(device, world):
    """A row-parallel last layer returns an AsyncCollectiveTensor; a loss whose
    backward keeps it (mse_loss) must see device tensors only (the checkpoint
    test's TP model crashed here once)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(device)
    tp = parallelize_module(net, init_device_mesh(device.type, (world,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
    out = tp(torch.ones(3, 4, device=device))
    torch.nn.functional.mse_loss(out, torch.zeros(3, 2, device=device)).backward()
    return type(out).__name__, tp[1].weight.grad is not None


def _fsdp2_with_a_frozen_layer(device):
    """A frozen parameter leaves FSDP2 an unshard to finish in finalize_backward,
    which waits on torch.accelerator.current_stream() (the notebook's case)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(device)
    model[0].weight.requires_grad_(False)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for _ in range(2):
        model(torch.tensor([[1, 2, 3]], device=device)).sum().backward()


def test_collectives_on_device_tensors_run_over_gloo_as_tpu_dist():
    results = _in_child(_collectives, world_size=2)
    for backend, device, total, gathered, sizes, twin_device, same, is_param, errors, tp_out in results:
        assert tp_out == ("AsyncCollectiveTensor", True)
        assert (backend, device, total, gathered, sizes) == ("tpu_dist", "tpu", [3.0, 3.0, 3.0], [0.0, 1.0], [10, 17])
        assert (twin_device, same, is_param) == ("tpu", True, True)
        assert len(errors) == 2, errors
        assert "No backend type associated with device type cpu" in errors[0]
        assert "has no backend for device type tpu (its backend is 'gloo')" in errors[1]


def _in_place_metadata(rank, world):
    import ray_train_tpu

    device = ray_train_tpu.get_device()
    a = torch.arange(4.0, device=device)
    a.resize_(6)
    out = torch.empty(0, device=device)
    torch.add(torch.ones(3, device=device), 1, out=out)
    b, host = torch.zeros(2, 3, device=device), torch.zeros(2, 3)
    for t in (b, host):
        t.t_()
        t.unsqueeze_(0)
    c = torch.empty(0, device=device).set_(a)
    return [tuple(a.shape), out.cpu().tolist(), (tuple(b.shape), b.stride()) == (tuple(host.shape), host.stride()),
            tuple(c.shape), c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr(), a.device.type,
            out.device.type]


def test_in_place_ops_that_change_shape_or_storage_keep_the_device_tensor_right(checked):
    assert checked["in_place"] == [(6,), [2.0, 2.0, 2.0], True, (6,), True, "tpu", "tpu"]


def _refuses_a_taken_slot(rank, world):
    from ray_train_tpu._compat import simulated_tpu

    torch.utils.rename_privateuse1_backend("npu_like")
    try:
        simulated_tpu.install()
    except RuntimeError as e:
        return str(e)
    return "installed"


def test_it_refuses_to_simulate_where_privateuse1_belongs_to_another_backend():
    (message,) = _spawn.run(_refuses_a_taken_slot, 1, timeout_s=60)
    assert "already 'npu_like'" in message and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in message


def test_the_test_process_itself_never_simulates():
    from ray_train_tpu._compat import simulated_tpu

    assert not simulated_tpu.installed() and torch._C._get_privateuse1_backend_name() == "privateuseone"


def _host_stand_in(rank, world):
    import torch.distributed as dist

    import ray_train_tpu

    device = ray_train_tpu.get_device()
    total = torch.ones(2) * (rank + 1)
    dist.all_reduce(total)  # tpu_dist is gloo for host tensors in this mode
    return str(device), dist.get_backend(), total.tolist()


def test_the_host_stand_in_is_explicit_and_only_what_it_says(monkeypatch):
    """RAY_TRAIN_TPU_SIMULATE_DEVICE=host (benchmarks comparing per-step overhead with
    CPU baselines) makes the device the host itself; anything else is refused by name."""
    from ray_train_tpu import device

    monkeypatch.setenv("RAY_TRAIN_TPU_SIMULATE_DEVICE", "host")
    assert _in_child(_host_stand_in, world_size=2) == [("cpu", "tpu_dist", [3.0, 3.0])] * 2
    monkeypatch.setenv("RAY_TRAIN_TPU_SIMULATE_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"RAY_TRAIN_TPU_SIMULATE_DEVICE='gpu' must be one of tpu, host"):
        device.simulated_device_kind()


# -- torch_tpu 0.2.0's device surface: every public name of its device module, with meaning

def _torch_tpu_file(*parts):
    """A file of the installed torch_tpu, found without importing it."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("torch_tpu")
    assert spec is not None, "torch_tpu is not installed; the device surface is checked against it"
    return pathlib.Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)


def _torch_tpu_device_module_names():
    """The public names of torch_tpu's device module (``torch.tpu``), read from its source:
    methods and attributes of ``_DeviceModule``/``TpuDeviceModule``, the metaclass
    properties, and the staged names of ``__tt_api_stages__``."""
    import ast

    tree = ast.parse(_torch_tpu_file("_internal", "device", "_device_module.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("_DeviceModuleMeta", "_DeviceModule", "TpuDeviceModule"):
            for b in node.body:
                if isinstance(b, ast.FunctionDef):
                    names.add(b.name)
                elif isinstance(b, ast.Assign):
                    names |= {t.id for t in b.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "__tt_api_stages__":
            names |= {k.value for k in node.value.keys}
    return {n for n in names if not n.startswith("_")}


def _surface(rank, world):
    import os

    from torch.utils.checkpoint import checkpoint

    from ray_train_tpu._compat import simulated_tpu_runtime as rt
    from ray_train_tpu.device import describe_simulated_chip, get_device

    device = get_device()
    out = {}
    tpu = torch.get_device_module("tpu")
    out["names"] = set(dir(type(tpu)))
    out["refused"] = {}
    for name in rt.REFUSED:
        try:
            value = getattr(tpu, name)
            value() if callable(value) else None
        except rt.NotSimulatedError as e:
            out["refused"][name] = str(e)
    # autocast: matmuls in bf16 (equal to the host's bf16 result), losses in fp32, as torch_tpu's lists say
    a, b, target = torch.randn(16, 8), torch.randn(8, 4), torch.randint(0, 4, (16,))
    with torch.autocast("tpu", dtype=torch.bfloat16):
        mm = a.to(device) @ b.to(device)
        loss = torch.nn.functional.cross_entropy(mm, target.to(device))
    out["amp"] = {"mm": mm.dtype, "mm_equal": torch.equal(mm.cpu(), a.bfloat16() @ b.bfloat16()), "loss": loss.dtype,
                  "default_dtype": torch.get_autocast_dtype("tpu"),
                  "ops": {op.name(): policy for op, policy in rt.autocast_ops().items()}}
    with torch.autocast("tpu"):
        out["amp"]["default_mm"] = (a.to(device) @ b.to(device)).dtype
    # memory: the bytes of live device tensors
    torch.accelerator.synchronize()
    base = torch.accelerator.memory_allocated()
    torch.accelerator.reset_peak_memory_stats()
    x = torch.empty(4 * 2**20, dtype=torch.float32, device=device)  # 16 MiB
    model = torch.nn.Linear(256, 128).to(device)
    held = torch.accelerator.memory_allocated() - base
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    del x
    torch.accelerator.empty_cache()
    out["memory"] = {"held": held, "params": params, "after_free": torch.accelerator.memory_allocated() - base,
                     "peak": torch.accelerator.max_memory_allocated() - base, "tpu_api": tpu.memory_allocated() - base,
                     "stats": dict(torch.accelerator.memory_stats())}
    torch.accelerator.reset_peak_memory_stats()
    out["memory"]["peak_after_reset"] = torch.accelerator.max_memory_allocated() - base
    # the chip: the host's accelerator type, through the topology table
    before = tpu.get_device_name()
    try:
        tpu.get_device_properties()
        undescribed = None
    except RuntimeError as e:
        undescribed = str(e)
    os.environ["TPU_ACCELERATOR_TYPE"] = "v4-8"
    describe_simulated_chip()
    props = tpu.get_device_properties()
    out["chip"] = {"before": before, "undescribed": undescribed, "name": props.name, "total": props.total_memory,
                   "info_total": torch.accelerator.get_memory_info()[1]}
    # pinned host memory through a DataLoader
    data = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2))
    batches = list(torch.utils.data.DataLoader(data, batch_size=3, pin_memory=True))
    out["pinned"] = {"batches": [bt[0].is_pinned() for bt in batches], "host": torch.ones(2).is_pinned(),
                     "moved": torch.equal(torch.cat([bt[0].to(device, non_blocking=True).cpu() for bt in batches]),
                                          torch.arange(12.0).reshape(6, 2))}
    # streams and events
    start, end = tpu.Event(enable_timing=True), tpu.Event(enable_timing=True)
    start.record()
    (torch.randn(64, 64).to(device) @ torch.randn(64, 64).to(device)).sum().item()
    end.record()
    end.synchronize()
    stream = tpu.current_stream()
    out["streams"] = {"elapsed": start.elapsed_time(end), "query": stream.query(),
                      "default": stream == tpu.default_stream(), "accelerator": torch.accelerator.current_stream()
                      is stream, "record": type(stream.record_event()).__name__}
    try:
        start.ipc_handle()
    except NotImplementedError as e:
        out["streams"]["ipc"] = str(e)
    # generators: PyTorch's Python hooks cannot create one; the device's default generator drives draws
    try:
        torch.Generator(device="tpu")
    except NotImplementedError as e:
        out["generator_refused"] = str(e)
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        t = torch.empty(5, device=device)
        draws.append(t.normal_(generator=tpu.default_generators[0]).cpu())
    out["generator"] = {"same": torch.equal(*draws), "is_device_generator": tpu.default_generators[0] is
                        rt.device_generator}
    # activation checkpointing, both modes, dropout inside (the device's RNG state is replayed)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Dropout(0.5),
                              torch.nn.Linear(8, 1)).to(device)
    inp = torch.randn(4, 8).to(device).requires_grad_()  # reentrant checkpointing needs an input that does

    def grads(fn):
        net.zero_grad()
        torch.manual_seed(1)
        with torch.autocast("tpu", dtype=torch.bfloat16):
            fn(inp).float().sum().backward()
        return [p.grad.cpu().clone() for p in net.parameters()]

    plain = grads(net)
    out["checkpoint"] = {mode: all(torch.equal(g, h) for g, h in zip(plain, grads(
        lambda t, r=reentrant: checkpoint(net, t, use_reentrant=r)))) for mode, reentrant in
        (("reentrant", True), ("non_reentrant", False))}
    # torch.compile: the "tpu" backend and the default one, forward and backward equal to eager
    import time

    t0 = time.perf_counter()
    eager = grads(net), net(inp)
    compiled = torch.compile(net, backend="tpu")
    got = grads(compiled), compiled(inp)
    out["compile"] = {"tpu": all(torch.equal(g, h) for g, h in zip(eager[0], got[0]))
                      and torch.equal(eager[1].cpu(), got[1].cpu()) and got[1].device.type == "tpu"}
    step = torch.compile(lambda t: torch.nn.functional.gelu(t @ t.T) + 1)  # the default backend
    out["compile"]["default"] = torch.equal(step(inp).cpu(), (torch.nn.functional.gelu(inp @ inp.T) + 1).cpu())
    out["compile_s"] = time.perf_counter() - t0
    inductor = torch._TorchCompileInductorWrapper("default", None, False)
    try:
        inductor(torch.fx.symbolic_trace(net), [inp])
    except rt.NotSimulatedError as e:
        out["compile"]["inductor_refused"] = str(e)
    # fp16 loss scaling: torch_tpu has no kernel for unscaling
    scaler = torch.amp.GradScaler("tpu")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler.scale(net(inp).sum()).backward()
    try:
        scaler.unscale_(opt)
    except NotImplementedError as e:
        out["grad_scaler"] = str(e)
    # strict as before: a host tensor meeting a device tensor still fails under autocast
    from ray_train_tpu._compat.simulated_tpu import DeviceMismatchError

    try:
        with torch.autocast("tpu", dtype=torch.bfloat16):
            net(torch.randn(4, 8))
    except DeviceMismatchError:
        out["strict"] = True
    return out


@pytest.fixture(scope="module")
def surface():
    return _in_child(_surface)[0]


def test_the_device_module_has_every_public_name_of_torch_tpus_or_a_tested_refusal(surface):
    theirs = _torch_tpu_device_module_names()
    assert {"get_amp_supported_dtype", "synchronize", "get_device_properties", "Stream", "Event",
            "default_generators"} <= theirs  # the reader reads the class
    missing = theirs - surface["names"]
    assert not missing, f"torch_tpu's torch.tpu has {sorted(missing)}; the simulated device module lacks them"
    from ray_train_tpu._compat.simulated_tpu_runtime import REFUSED

    assert REFUSED <= theirs and set(surface["refused"]) == set(REFUSED)
    assert all("not simulated" in m and "SIMULATED" in m for m in surface["refused"].values())


def test_autocast_uses_torch_tpus_own_op_lists_and_computes_matmuls_in_bf16(surface):
    import re
    import subprocess

    from ray_train_tpu._compat.simulated_tpu_runtime import torch_tpu_glue_library

    amp = surface["amp"]
    assert amp["mm"] == torch.bfloat16 and amp["mm_equal"], amp
    assert amp["loss"] == torch.float32 and amp["default_dtype"] == torch.bfloat16
    assert amp["default_mm"] == torch.bfloat16
    # torch_tpu's kernels, demangled by c++filt: WrapFunction_<CastPolicy, DeviceType 20 (PrivateUse1), ..., &at::_ops::X::call>
    blob = open(torch_tpu_glue_library(), "rb").read()
    mangled = sorted(set(re.findall(rb"_ZN2at8autocast13WrapFunction_I[0-9A-Za-z_]+", blob)))
    demangled = subprocess.run(["c++filt"], input=b"\n".join(mangled), capture_output=True, check=True).stdout.decode()
    theirs = {}
    for line in demangled.splitlines():
        m = re.search(r"CastPolicy\)(\d), \(c10::DeviceType\)20,.*?&at::_ops::(\w+)::call", line)
        if m:
            theirs.setdefault(m.group(2), int(m.group(1)))
    assert len(theirs) > 50 and theirs["mm"] == 0 and theirs["cross_entropy_loss"] == 1
    policies = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote")
    ours = amp["ops"]
    for struct, policy in theirs.items():
        base = struct if f"aten::{struct}" in ours else None
        matches = [name for name in ours if name.replace("aten::", "").replace(".", "_") == struct
                   or name == f"aten::{struct}"] if base is None else [f"aten::{struct}"]
        assert matches and all(ours[n] == policies[policy] for n in matches), (struct, policy, matches)
    assert len(ours) == len(theirs)


def test_memory_statistics_count_live_device_tensor_bytes(surface):
    mem = surface["memory"]
    mib16 = 16 * 2**20
    assert mem["held"] == mib16 + mem["params"] and mem["params"] == (256 * 128 + 128) * 4
    assert mem["after_free"] == mem["params"] and mem["tpu_api"] == mem["params"]
    assert mem["peak"] == mem["held"] and mem["peak_after_reset"] == mem["params"]
    assert mem["stats"]["allocated_bytes.all.peak"] >= mib16
    assert mem["stats"]["reserved_bytes.all.current"] == mem["stats"]["allocated_bytes.all.current"]


def test_device_name_and_hbm_are_torch_tpus_for_the_hosts_generation(surface):
    import ast

    source = _torch_tpu_file("_internal", "utils", "hardware.py").read_text()
    tree = ast.parse(source)
    names, hbm_v4 = set(), None
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_PCI_DEVICE_ID_TO_NAME":
            names = {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and
                     str(c.value).startswith("TPU ")}
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_HBM_BYTES_PER_CHIP":
            for k, v in zip(*(lambda d: (d.keys, d.values))(next(n for n in ast.walk(node.value)
                                                                  if isinstance(n, ast.Dict)))):
                if ast.unparse(k) == "TpuVersion.V4":
                    hbm_v4 = eval(ast.unparse(v))
    chip = surface["chip"]
    assert chip["before"] == "TPU" and "unrecognized TPU 'TPU'" in chip["undescribed"]  # torch_tpu's own answers
    from ray_train_tpu.device import TORCH_TPU_CHIP_NAMES

    assert set(TORCH_TPU_CHIP_NAMES.values()) <= names
    assert chip["name"] == "TPU v4" and chip["total"] == hbm_v4 == chip["info_total"]


def test_pinned_memory_streams_and_events_as_torch_tpu_has_them(surface):
    assert surface["pinned"] == {"batches": [True, True], "host": False, "moved": True}
    streams = surface["streams"]
    assert streams["elapsed"] > 0 and streams["query"] and streams["default"] and streams["accelerator"]
    assert streams["record"] == "Event"
    # torch_tpu's TpuEvent.ipc_handle raises NotImplementedError too
    assert "raise NotImplementedError" in _torch_tpu_file("_internal", "stream", "streams.py").read_text()
    assert "ipc_handle" in streams["ipc"]


def test_device_generators_refused_by_pytorch_and_the_default_one_reproducible(surface):
    assert "getNewGenerator" in surface["generator_refused"]  # docs/simulation.md names this refusal
    assert surface["generator"] == {"same": True, "is_device_generator": True}


def test_activation_checkpointing_both_modes_gives_the_plain_backwards_gradients(surface):
    assert surface["checkpoint"] == {"reentrant": True, "non_reentrant": True}


def test_torch_compile_tpu_backend_and_default_equal_eager_and_inductor_refuses_device_graphs(surface):
    compiled = surface["compile"]
    assert compiled["tpu"] and compiled["default"], compiled
    assert 'backend="tpu"' in compiled["inductor_refused"]


def test_fp16_grad_scaler_is_refused_as_torch_tpu_lacks_the_unscale_kernel(surface):
    import pathlib

    import accelerate

    # accelerate's own note, and torch_tpu's libraries: no kernel of that name anywhere
    source = (pathlib.Path(accelerate.__file__).parent / "accelerator.py").read_text()
    assert "TorchTPU lacks `_amp_foreach_non_finite_check_and_unscale_`" in source
    for lib in _torch_tpu_file().rglob("*2_13_0*.so"):
        assert b"_amp_foreach_non_finite_check_and_unscale_" not in lib.read_bytes(), lib
    assert "_amp_foreach_non_finite_check_and_unscale_" in surface["grad_scaler"]
    assert surface["strict"]
