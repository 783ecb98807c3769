"""Strategies: the registry, their errors, and numerical equivalence on the simulated TPU device/gloo.

Every distributed strategy trains the same MLP (fixed seed) for `STEPS` steps,
each rank on its data-parallel shard of one global batch, and must end with the
same full parameters (gathered with ``get_model_state_dict(full_state_dict=True)``)
as one process trained on the whole batch.

Tolerance: ``atol=1e-6, rtol=1e-5``. Only the order of additions differs
(gradients summed across ranks and then divided, matmuls split over
tensor-parallel shards), which moves results by a few ulp per step.

- SGD runs in float32: a step moves a weight by ``lr * grad``, so a gradient that
  differs in its last bits (float32 eps is 1.2e-7) moves the weight by ``lr`` times
  that; TPU_FACTS measured ~1e-8 for this kind of model, two orders of magnitude
  inside the bound.
- AdamW runs in float64. Its update ``lr * m / (sqrt(v) + eps_adam)`` divides by the
  gradient's own size, so a last-bit difference in a gradient near zero becomes a
  difference of up to ``lr * dg / eps_adam`` (= 1e6 dg here) in the weight: in
  float32 no fixed tolerance is safe on every CPU (a summation order that rounds
  a near-zero gradient the other way moves a weight by ~1e-5). In float64 a
  reordered sum of n terms moves a gradient by at most ~2 n u max|g| (u = 2^-53;
  n = GLOBAL_BATCH x the widest layer = 512, max|g| < 1 here): 1.1e-13, times the
  amplification 1e6 and `STEPS` steps: 6e-7 < ``ATOL``, and measured differences
  are ~1e-16.

The negative controls below (no gradient averaging, another seed) are off by > 1e-3.

bf16 mixed precision (``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``; float32 master weights) is looser: bfloat16 keeps 8
bits of mantissa (eps 7.8e-3), so every forward/backward is off by ~1e-2
relative. With SGD the parameters must stay within ``atol=5e-3`` (measured
7e-4). With AdamW single weights are not comparable: its first updates are
~lr * sign(grad), so a gradient that bfloat16 rounds across zero moves that
weight by 2 * lr = 0.02; there the whole update (final - initial weights) must
match the fp32 update to 10% in L2 norm (measured 4%; without gradient
averaging it is off by far more).

The distributed runs are grouped: one spawned world of 2 and one of 4 ranks
train every case (module fixtures); the tests then compare. Each test prints
its max abs difference (``pytest -s``) and reports it in its assertion.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ray_train_tpu.device import get_device
from ray_train_tpu.testing import gloo as _spawn
from ray_train_tpu.mesh import MeshLayout
from ray_train_tpu.strategies import (
    DDPStrategy,
    FSDP2Strategy,
    FSDP2TPStrategy,
    ModelParallelStrategy,
    Strategy,
    TensorParallelStrategy,
    get_strategy,
)
from ray_train_tpu.strategies import ddp as ddp_module
from ray_train_tpu.strategies.tensor_parallel import apply_tp
from ray_train_tpu.topology import Topology

SEED = 0
STEPS = 5
GLOBAL_BATCH = 16
ATOL, RTOL = 1e-6, 1e-5
BF16_ATOL = 5e-3
BF16_ADAMW_UPDATE_RTOL = 0.1
OPTIMIZERS = ("sgd", "adamw")
# AdamW amplifies last-bit gradient differences (module doc): it trains in float64.
DTYPES = {"sgd": torch.float32, "adamw": torch.float64}
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
V4_2x2x2 = Topology.parse("2x2x2", "TPU-V4")


def mlp(seed: int = SEED, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    return model.to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x.to(dtype), y.to(dtype)


def optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def train(model: nn.Module, opt_name: str, num_replicas: int = 1, rank: int = 0,
          device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """`STEPS` steps, each on shard `rank` of `num_replicas` of the global batch."""
    opt = optimizer(opt_name, model.parameters())
    for step in range(STEPS):
        x, y = (t.chunk(num_replicas)[rank].to(device) for t in batch(step, dtype))
        loss = F.mse_loss(model(x).to(dtype), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def reference(opt_name: str, seed: int = SEED) -> dict[str, torch.Tensor]:
    model = mlp(seed, DTYPES[opt_name])
    train(model, opt_name, dtype=DTYPES[opt_name])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# Worker side (runs in spawned ranks) -------------------------------------------------


def _model_parallel_fn(model: nn.Module, mesh) -> nn.Module:
    parallelize_module(model, mesh["tp"], PLAN)
    for child in model:
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _strategy(case: str, world_size: int) -> tuple[Strategy, int]:
    """(strategy, num_slices) for a case name."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "ddp": (DDPStrategy(), 1),
        "fsdp2": (FSDP2Strategy(), 1),
        "fsdp2_hsdp": (FSDP2Strategy(), 2),  # 2 simulated slices: replicate x shard
        "fsdp2_bf16": (FSDP2Strategy(mp_policy=bf16), 1),
        "tp": (TensorParallelStrategy(plan=PLAN), 1),
        "fsdp2+tp": (FSDP2TPStrategy(tp_size=2, plan=PLAN), 1),
        "model_parallel": (
            ModelParallelStrategy(parallelize_fn=_model_parallel_fn, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp")),
            1,
        ),
    }[case]


RESUME_AT = 3


def _resume_model() -> nn.Module:
    torch.manual_seed(SEED)
    # ~200k parameters (0.8 MB): DDP's rebuilt bucket order differs from its first one
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))])


def _resume_run(rank: int, strategy: DDPStrategy, state=None, steps=range(STEPS)):
    device = get_device()
    model = _resume_model()
    if state:
        model.load_state_dict(state[0])
    model = strategy.parallelize(model, device)
    opt = optimizer("adamw", model.parameters())
    if state:
        opt.load_state_dict(state[1])
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = model(torch.randn(16, 64, generator=g).to(device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _resume_diffs(rank: int) -> dict:
    """Max abs difference, uninterrupted run vs one rebuilt from its state after
    RESUME_AT steps (as from a checkpoint), with and without a fixed bucket order."""
    import copy

    out = {}
    for name, strategy in (("fixed", DDPStrategy()), ("rebuild", DDPStrategy(fixed_bucket_order=False))):
        full, _ = _resume_run(rank, strategy)
        model, opt = _resume_run(rank, strategy, steps=range(RESUME_AT))
        state = copy.deepcopy((model.module.state_dict(), opt.state_dict()))
        resumed, _ = _resume_run(rank, strategy, state, steps=range(RESUME_AT, STEPS))
        out[name] = max_abs_diff(full.module.state_dict(), resumed.module.state_dict())
    return out


def _train_case(rank: int, world_size: int, case: str) -> dict:
    """Train `case` with every optimizer; one mesh per case (meshes cost group set-ups)."""
    if case == "ddp_resume":
        return {"adamw": _resume_diffs(rank)}
    if case == "no_grad_avg":  # negative control: each rank trains alone on its shard
        out = {}
        for opt_name in OPTIMIZERS:
            model = mlp(dtype=DTYPES[opt_name])
            train(model, opt_name, world_size, rank, dtype=DTYPES[opt_name])
            out[opt_name] = {"state": model.state_dict() if rank == 0 else None, "meta": {}}
        return out
    strategy, num_slices = _strategy(case, world_size)
    device = get_device()
    assert device.type == "tpu"  # the simulated TPU device: host tensors must be moved to it
    strategy.setup(device, world_size, None, num_slices)
    # bf16 mixed precision keeps float32 masters (its bounds below are bf16's, not AdamW's).
    dtypes = {opt_name: torch.float32 for opt_name in OPTIMIZERS} if case == "fsdp2_bf16" else DTYPES
    return {opt_name: _train_one(rank, strategy, opt_name, device, dtypes[opt_name]) for opt_name in OPTIMIZERS}


def _train_one(rank: int, strategy: Strategy, opt_name: str, device: torch.device, dtype: torch.dtype) -> dict:
    model = strategy.parallelize(mlp(dtype=dtype), device)
    kw = strategy.distributed_sampler_kwargs
    opt = train(model, opt_name, kw["num_replicas"], kw["rank"], device, dtype)
    weight = getattr(model, "module", model)[0].weight  # DDP wraps in .module
    meta = {
        "sampler": kw,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "opt_state_dtypes": sorted(
            {str(v.dtype) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()}
        ),
        "local_shape_0": tuple(weight.to_local().shape) if hasattr(weight, "to_local") else None,
        "mesh": None if strategy._mesh is None else strategy.device_mesh.mesh.tolist(),
    }
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"state": {k: v.detach().cpu() for k, v in state.items()} if rank == 0 else None, "meta": meta}


def _train_all(rank: int, world_size: int, cases: tuple) -> dict:
    return {
        (case, opt): result
        for case in cases
        for opt, result in _train_case(rank, world_size, case).items()
    }


# Fixtures: one spawned world per size ----------------------------------------------------

CASES_2 = ("ddp", "tp")
CASES_4 = ("ddp", "fsdp2", "fsdp2_hsdp", "fsdp2_bf16", "fsdp2+tp", "model_parallel", "no_grad_avg", "ddp_resume")


@pytest.fixture(scope="module")
def world2():
    return _spawn.run(_train_all, 2, CASES_2, timeout_s=240, simulate_tpu=True)


@pytest.fixture(scope="module")
def world4():
    return _spawn.run(_train_all, 4, CASES_4, timeout_s=480, simulate_tpu=True)


@pytest.fixture(scope="module")
def refs():
    return {opt: reference(opt) for opt in OPTIMIZERS}


def _check_close(results, case, opt, refs, atol=ATOL, rtol=RTOL) -> float:
    state = results[0][(case, opt)]["state"]
    diff = max_abs_diff(state, refs[opt])
    print(f"{case} world={len(results)} {opt}: max abs diff {diff:.3g}")
    for k, v in state.items():
        torch.testing.assert_close(
            v, refs[opt][k], atol=atol, rtol=rtol,
            msg=lambda m: f"{case}/{opt} {k}: {m} (max abs diff over all params {diff:.3g})",
        )
    return diff


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("case", CASES_2)
def test_world2_matches_single_process(world2, refs, case, opt):
    _check_close(world2, case, opt, refs)


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("case", ["ddp", "fsdp2", "fsdp2_hsdp", "fsdp2+tp", "model_parallel"])
def test_world4_matches_single_process(world4, refs, case, opt):
    _check_close(world4, case, opt, refs)


def test_sharding_really_happened(world2, world4):
    # TP splits Linear(16, 32) column-wise over 2 ranks: 16 rows each.
    assert world2[0][("tp", "sgd")]["meta"]["local_shape_0"] == (16, 16)
    # FSDP2 over 4 ranks: 32 rows / 4. FSDP2+TP: TP halves, then FSDP halves again.
    assert world4[0][("fsdp2", "sgd")]["meta"]["local_shape_0"] == (8, 16)
    assert world4[0][("fsdp2+tp", "sgd")]["meta"]["local_shape_0"] == (8, 16)
    # Ranks of one tp group read the same data shard; dp ranks read different ones.
    samplers = [r[("fsdp2+tp", "sgd")]["meta"]["sampler"] for r in world4]
    assert samplers == [{"num_replicas": 2, "rank": rank // 2} for rank in range(4)]
    assert world4[0][("fsdp2+tp", "sgd")]["meta"]["mesh"] == [[[0, 1], [2, 3]]]  # dp_replicate, dp_shard, tp
    assert world4[0][("fsdp2_hsdp", "sgd")]["meta"]["mesh"] == [[[0], [1]], [[2], [3]]]


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_skipping_gradient_averaging_fails_the_tolerance(world4, refs, opt):
    state = world4[0][("no_grad_avg", opt)]["state"]
    diff, err = max_abs_diff(state, refs[opt]), _update_error(state, refs[opt])
    print(f"no_grad_avg {opt}: max abs diff {diff:.3g}, relative update error {err:.3g}")
    assert diff > 100 * ATOL, f"the equivalence tests could not tell (max abs diff {diff:.3g})"
    assert err > BF16_ADAMW_UPDATE_RTOL, f"the bf16 update bound could not tell (relative update error {err:.3g})"


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_another_seed_fails_the_tolerance(refs, opt):
    diff = max_abs_diff(reference(opt, seed=SEED + 1), refs[opt])
    assert diff > 100 * ATOL, f"max abs diff {diff:.3g}"


def test_adamw_bound_premise_gradients_below_one():
    """The AdamW tolerance (module doc) assumes every gradient entry is below 1 in size."""
    model, largest = mlp(dtype=torch.float64), 0.0
    opt = optimizer("adamw", model.parameters())
    for step in range(STEPS):
        x, y = batch(step, torch.float64)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        largest = max(largest, max(p.grad.abs().max().item() for p in model.parameters()))
        opt.step()
    assert 1e-3 < largest < 1.0, largest


def _update_error(state: dict, ref: dict) -> float:
    """|bf16 update - fp32 update| / |fp32 update|, over all parameters (updates from the initial weights)."""
    init = mlp(dtype=torch.float64).state_dict()
    num = sum(((state[k] - ref[k]) ** 2).sum() for k in ref)
    den = sum(((ref[k] - init[k]) ** 2).sum() for k in ref)
    return (num / den).sqrt().item()


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_fsdp2_bf16_keeps_fp32_master_params(world4, opt):
    for rank_result in world4:
        meta = rank_result[("fsdp2_bf16", opt)]["meta"]
        assert meta["param_dtypes"] == ["torch.float32"]
        assert meta["opt_state_dtypes"] in ([], ["torch.float32"])
    assert all(v.dtype == torch.float32 for v in world4[0][("fsdp2_bf16", opt)]["state"].values())


def test_fsdp2_bf16_sgd_stays_close_to_fp32(world4, refs):
    diff = _check_close(world4, "fsdp2_bf16", "sgd", refs, atol=BF16_ATOL, rtol=0)
    assert diff > 10 * ATOL, f"bf16 compute should differ from fp32 (max abs diff {diff:.3g}); was the policy applied?"


def test_fsdp2_bf16_adamw_update_stays_close_to_fp32(world4, refs):
    # Adam's first steps are ~lr * sign(grad): a gradient that bf16 rounds across zero
    # moves that weight by 2 * lr, so compare the whole update, not single weights.
    state = world4[0][("fsdp2_bf16", "adamw")]["state"]
    err, diff = _update_error(state, refs["adamw"]), max_abs_diff(state, refs["adamw"])
    print(f"fsdp2_bf16 world=4 adamw: max abs diff {diff:.3g}, relative update error {err:.3g}")
    assert 1e-4 < err < BF16_ADAMW_UPDATE_RTOL, f"relative update error {err:.3g} (max abs diff {diff:.3g})"


# Registry and errors (driver side, no processes) -----------------------------------------


def test_registry_names_and_default():
    assert isinstance(get_strategy(), DDPStrategy)
    assert isinstance(get_strategy("ddp"), DDPStrategy)
    assert isinstance(get_strategy(" FSDP2 "), FSDP2Strategy)
    s = FSDP2TPStrategy(tp_size=2, plan=PLAN)
    assert get_strategy(s) is s


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ValueError, match=r"strategy 'zero3' is not known; valid: ddp, fsdp2, tp, fsdp2\+tp"):
        get_strategy("zero3")
    with pytest.raises(TypeError, match="must be a name"):
        get_strategy(3)


@pytest.mark.parametrize("name", ["tp", "fsdp2+tp"])
def test_tensor_parallel_without_plan_says_how_to_give_one(name):
    with pytest.raises(ValueError, match=r"needs exactly one of plan=\{'0': ColwiseParallel\(\).*parallelize_fn=fn\(model, tp_mesh\)"):
        get_strategy(name)


def test_model_parallel_without_fn_says_how():
    with pytest.raises(ValueError, match=r"parallelize_fn=None\) must be a function fn\(model, mesh\)"):
        get_strategy("model_parallel")


def test_bad_plan_and_policy_types():
    with pytest.raises(TypeError, match="maps submodule names"):
        TensorParallelStrategy(plan={"0": "colwise"})
    with pytest.raises(ValueError, match="got both"):
        TensorParallelStrategy(plan=PLAN, parallelize_fn=lambda m, mesh: m)
    with pytest.raises(TypeError, match="must be a torch.distributed.fsdp.MixedPrecisionPolicy"):
        FSDP2Strategy(mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(TypeError, match="shard_modules"):
        FSDP2Strategy(shard_modules=["Linear"])
    assert FSDP2Strategy(shard_modules=[nn.Linear]).shard_modules == (nn.Linear,)


def test_strategies_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FSDP2Strategy().reshard_after_forward = False


def test_tp_size_not_dividing_devices_per_host():
    s = FSDP2TPStrategy(tp_size=3, plan=PLAN)
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the 4 devices per host of TPU-V4 2x2x2 \(v4-16\); use 1, 2 or 4"):
        s.validate(V4_2x2x2, num_slices=1, world_size=8)


def test_tp_without_data_parallel_averaging_is_refused():
    with pytest.raises(ValueError, match=r"tp_size=4\) leaves 2 data-parallel replicas.*FSDP2TPStrategy"):
        TensorParallelStrategy(plan=PLAN, tp_size=4).validate(V4_2x2x2, 1, 8)
    # tp over the whole slice would cross hosts
    with pytest.raises(ValueError, match="tp_size=8 does not divide the 4 devices per host"):
        TensorParallelStrategy(plan=PLAN).validate(V4_2x2x2, 1, 8)


def test_fsdp2_tp_defaults_to_one_host_per_tp_group():
    s = FSDP2TPStrategy(plan=PLAN)
    assert s.validate(V4_2x2x2, num_slices=2, world_size=16) == MeshLayout(
        shape=(2, 2, 4), dim_names=("dp_replicate", "dp_shard", "tp")
    )
    with pytest.raises(ValueError, match=r"tp_size=None\) means all devices of a host.*pass tp_size=N"):
        s.validate(None, num_slices=1, world_size=4)


def test_world_size_must_fill_the_slices():
    with pytest.raises(ValueError, match=r"world_size 6 does not fill num_slices=1 x TPU-V4 2x2x2 \(v4-16\).*8 in all"):
        DDPStrategy().validate(V4_2x2x2, num_slices=1, world_size=6)


def test_model_parallel_mesh_product_must_equal_world_size():
    s = ModelParallelStrategy(parallelize_fn=_model_parallel_fn, mesh_shape=[2, 3], mesh_dim_names=["dp", "tp"])
    assert s.mesh_shape == (2, 3)
    with pytest.raises(ValueError, match=r"mesh_shape=\(2, 3\)\) has 6 ranks but world_size is 4; the product"):
        s.validate(None, num_slices=1, world_size=4)
    bad = ModelParallelStrategy(parallelize_fn=_model_parallel_fn, mesh_shape=(2, 4), mesh_dim_names=("tp", "dp"))
    with pytest.raises(ValueError, match="'tp' must be last"):
        bad.validate(V4_2x2x2, 1, 8)
    with pytest.raises(ValueError, match="one name per dimension"):
        ModelParallelStrategy(parallelize_fn=_model_parallel_fn, mesh_shape=(2, 2), mesh_dim_names=("dp",))


def test_parallelize_before_setup_names_the_fix():
    with pytest.raises(RuntimeError, match=r"call strategy.setup\(device, world_size, topology, num_slices\)"):
        FSDP2Strategy().parallelize(mlp(), torch.device("cpu"))


def test_ddp_on_one_worker_is_not_wrapped():
    model = mlp()
    assert DDPStrategy().parallelize(model, torch.device("cpu")) is model


@pytest.mark.parametrize("device, expected", [
    ("cpu", {}),
    ("privateuseone", {}),  # torch_tpu's "tpu" is PrivateUse1 renamed: DDP without device_ids
    ("cuda:0", {"device_ids": [torch.device("cuda:0")]}),
])
def test_ddp_passes_device_ids_only_on_cuda(monkeypatch, device, expected):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(ddp_module, "to_device", lambda model, device: model)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda model, **kw: calls.append(kw) or model)
    fixed = []
    monkeypatch.setattr(ddp_module, "fixed_order_ddp", lambda model, **kw: fixed.append(kw) or model)
    DDPStrategy().parallelize(mlp(), torch.device(device))
    assert fixed == [expected] and calls == []  # exact resume is the default
    DDPStrategy(fixed_bucket_order=False).parallelize(mlp(), torch.device(device))
    assert calls == [{"find_unused_parameters": False, **expected}]
    DDPStrategy(find_unused_parameters=True).parallelize(mlp(), torch.device(device))  # never rebuilds anyway
    assert calls[-1] == {"find_unused_parameters": True, **expected} and len(fixed) == 1


def test_fixed_order_ddp_buckets_are_fixed_from_the_first_step_last_layer_first(tmp_path):
    """The buckets of the first step are those of every later step (no rebuild), and
    the last layer's gradients, which backward produces first, are reduced first."""
    import pickle

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        torch.manual_seed(0)
        # 2.4 MB, 24 kB, 44 kB, 2 MB of float32: more than DDP's 1 MB first bucket
        model = nn.Sequential(nn.Linear(1000, 600), nn.Linear(600, 10), nn.Linear(10, 1000), nn.Linear(1000, 500))
        ddp = ddp_module.fixed_order_ddp(model)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        assert pickle.loads(pickle.dumps(type(ddp))) is type(ddp)  # the class pickles by name
        layouts = []
        for _ in range(3):
            ddp(torch.randn(4, 1000)).sum().backward()
            layouts.append([[tuple(p.shape) for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()])
        assert layouts[0] == layouts[1] == layouts[2]
        assert layouts[0][0] == [(500,), (500, 1000)]  # the last layer, alone in the first (1 MB) bucket
        assert layouts[0][-1][-1] == (600, 1000)  # the first layer, last
    finally:
        dist.destroy_process_group()


def test_ddp_flags_must_be_bools():
    for field in ("find_unused_parameters", "fixed_bucket_order"):
        with pytest.raises(TypeError, match=rf"DDPStrategy\({field}='yes'\) must be True or False"):
            DDPStrategy(**{field: "yes"})


def test_ddp_resume_is_bitwise_exact_with_the_default_fixed_bucket_order(world4):
    """A DDP run rebuilt from a copy of its state after RESUME_AT steps ends bitwise
    equal to the uninterrupted run with the default strategy. Control: with DDP's
    own bucket rebuild (fixed_bucket_order=False) the resumed run's first step sums
    the gradients in one bucket where the uninterrupted run used the rebuilt ones,
    and 4 ranks' all-reduce then rounds differently."""
    diffs = [r[("ddp_resume", "adamw")] for r in world4]
    print(f"ddp resume, max abs diff per rank: {diffs}")
    assert all(d["fixed"] == 0.0 for d in diffs), diffs
    assert any(d["rebuild"] > 0.0 for d in diffs), f"the control no longer differs: {diffs}"


def test_tp_plan_names_must_exist_and_fn_must_return_the_model():
    with pytest.raises(ValueError, match=r"plan names submodules the model does not have: \['layers.0'\]"):
        apply_tp(mlp(), None, {"layers.0": ColwiseParallel()}, None)
    with pytest.raises(TypeError, match="parallelize_fn must return the parallelized nn.Module, got NoneType"):
        apply_tp(mlp(), None, None, lambda model, mesh: None)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)


class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])


def _tp_with_pattern(rank: int, world_size: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = apply_tp(_Layers(), init_device_mesh("cpu", (world_size,)), {"layers.*.attention": ColwiseParallel()}, None)
    return [type(b.attention.weight).__name__ == DTensor.__name__ and isinstance(b.attention.weight, DTensor)
            and not isinstance(b.mlp.weight, DTensor) for b in model.layers]


def test_tp_plan_accepts_torchs_fnmatch_keys():
    # torchtitan-style keys: one pattern for every block, as parallelize_module accepts them
    assert _spawn.run(_tp_with_pattern, 2) == [[True, True], [True, True]]
    with pytest.raises(ValueError, match=r"does not have: \['layers.\*.atention'\].*'layers.\*.attention'"):
        apply_tp(_Layers(), None, {"layers.*.atention": ColwiseParallel()}, None)
    with pytest.raises(ValueError, match=r"does not have: \['layers.\*'\]"):
        apply_tp(mlp(), None, {"layers.*": ColwiseParallel()}, None)
