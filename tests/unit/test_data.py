"""stateful_dataloader: rank shards, and a saved position resumes exactly."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_train_tpu.data import ShardedStatefulDataLoader, stateful_dataloader

N = 40


def _loader(**kw):
    args = dict(batch_size=3, rank=1, world_size=2, seed=5)
    args.update(kw)
    return stateful_dataloader(list(range(N)), **args)


def _epochs(loader, epochs, start=0):
    """Every batch of epochs start..epochs-1, as lists, in order."""
    out = []
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        out += [b.tolist() for b in loader]
    return out


def _resume_after(k: int, epochs: int = 3, **kw):
    """Consume k batches (across epochs), save, rebuild, load; return (seen, rest, full)."""
    full = _epochs(_loader(**kw), epochs)
    loader, seen, state = _loader(**kw), [], None
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            if len(seen) == k:
                break
            seen.append(batch.tolist())
            if len(seen) == k:
                state = loader.state_dict()
        if state is not None:
            break
    again = _loader(**kw)
    again.load_state_dict(state)
    return seen, _epochs(again, epochs, start=again.epoch), full


def test_ranks_read_disjoint_shards_covering_the_data():
    shards = [[i for b in _epochs(_loader(rank=r, world_size=4, batch_size=2), 1) for i in b] for r in range(4)]
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(N)) and all(len(s) == 10 for s in shards)


def test_epochs_reshuffle_with_seed_and_are_reproducible():
    a, b = _epochs(_loader(), 2), _epochs(_loader(), 2)
    assert a == b
    per_epoch = len(a) // 2
    assert a[:per_epoch] != a[per_epoch:]
    assert _epochs(_loader(seed=6), 1) != a[:per_epoch]


@pytest.mark.parametrize("k", [1, 2, 6, 7, 9])  # 6 batches per epoch: mid, last of epoch 0, into epoch 1
def test_resumed_loader_yields_exactly_the_unseen_batches(k):
    seen, rest, full = _resume_after(k)
    assert seen + rest == full
    assert seen == full[:k]


def test_state_saved_after_an_epoch_ended_resumes_at_the_next_epoch():
    loader = _loader()
    first = _epochs(loader, 1)
    state = loader.state_dict()  # after the for loop ran to its end
    assert state["epoch"] == 1
    again = _loader()
    again.load_state_dict(state)
    assert first + _epochs(again, 3, start=again.epoch) == _epochs(_loader(), 3)


@settings(max_examples=25, deadline=None)
@given(k=st.integers(0, 14), world=st.integers(1, 4), batch=st.integers(1, 5), drop_last=st.booleans())
def test_resume_is_exact_for_any_position_and_sharding(k, world, batch, drop_last):
    kw = dict(world_size=world, rank=world - 1, batch_size=batch, drop_last=drop_last)
    k = min(k, len(_epochs(_loader(**kw), 2)))
    if k == 0:
        loader = _loader(**kw)
        state = loader.state_dict()
        again = _loader(**kw)
        again.load_state_dict(state)
        assert _epochs(again, 2, start=again.epoch) == _epochs(_loader(**kw), 2)
        return
    seen, rest, full = _resume_after(k, epochs=2, **kw)
    assert seen + rest == full


def test_resume_with_worker_processes():
    seen, rest, full = _resume_after(4, epochs=2, num_workers=1)
    assert seen + rest == full


def test_loading_a_state_of_another_sharding_names_the_field():
    state = _loader().state_dict()
    with pytest.raises(ValueError, match=r"saved with seed=5, this loader has seed=6"):
        _loader(seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with batch_size=3, this loader has batch_size=4"):
        _loader(batch_size=4).load_state_dict(state)  # same world: the same batches
    with pytest.raises(ValueError, match=r"saved with batch_size=3, this loader has batch_size=2"):
        _loader(world_size=4, batch_size=2).load_state_dict(state)  # per-rank policy keeps the per-rank batch
    with pytest.raises(ValueError, match=r"saved with global_batch_size=None, this loader has global_batch_size=6"):
        _loader(batch_size=None, global_batch_size=6, world_size=3, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"without 'epoch'"):
        _loader().load_state_dict({"loader": {}})


# ------------------------------------------------------------------ world-size changes


def _order(epoch, n=N, seed=5):
    """The epoch's order, from torch's own DistributedSampler (one replica)."""
    whole = torch.utils.data.DistributedSampler(list(range(n)), num_replicas=1, rank=0, shuffle=True, seed=seed)
    whole.set_epoch(epoch)
    return list(whole)


def _world(world, n, policy, **kw):
    size = {"global_batch_size": policy} if policy else {}
    return [stateful_dataloader(list(range(n)), rank=r, world_size=world, seed=5, **size, **kw) for r in range(world)]


def _batches_left(world, n, policy, state, **kw):
    """Batches rank 0 of `world` would still read in epoch 0 after loading `state`."""
    loader = _world(world, n, policy, **kw)[0]
    if state is not None:
        loader.load_state_dict(state)
    loader.set_epoch(0)
    return sum(1 for _ in loader)


def _take(loaders, k):
    """k batches from every rank (lockstep), flattened per rank; then rank 0's state."""
    seen = []
    for loader in loaders:
        loader.set_epoch(loader.epoch)
        it = iter(loader)
        seen += [i for _ in range(k) for i in next(it).tolist()]
    return seen, loaders[0].state_dict()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 30), worlds=st.lists(st.integers(1, 4), min_size=2, max_size=3),
       ks=st.lists(st.integers(0, 6), min_size=2, max_size=2), b=st.integers(1, 3), drop_last=st.booleans(),
       global_policy=st.booleans())
def test_a_world_size_change_mid_epoch_sees_no_sample_twice_and_skips_none(n, worlds, ks, b, drop_last, global_policy):
    """Epoch 0 read by worlds[0] for ks[0] batches, by worlds[1] for ks[1] more, then by the
    last world to its end: together the samples are the epoch's order once, skipping only
    what drop_last drops at the end (padding repeats only there)."""
    import math

    policy = b * math.lcm(*worlds) if global_policy else None
    size = {} if policy else {"batch_size": b}
    seen, state, last = [], None, worlds[-1]
    for i, world in enumerate(worlds):
        loaders = [l for l in _world(world, n, policy, drop_last=drop_last, **size)]
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
            if loaders[0].epoch == 1:  # the rest of epoch 0 holds no batch for this world: it starts epoch 1
                last = world
                break
        if i < len(worlds) - 1:
            left = _batches_left(world, n, policy, state, drop_last=drop_last, **size)
            k = min(ks[i], max(0, left - 1))  # stay inside the epoch
            got, state = _take(loaders, k)
            seen += got
            assert state["epoch"] == 0
        else:
            for loader in loaders:
                loader.set_epoch(0)
                seen += [i for batch in loader for i in batch.tolist()]
    order = _order(0, n)
    if drop_last:
        assert len(seen) == len(set(seen)), "a sample was seen twice"
        assert sorted(seen) == sorted(order[: len(seen)]), "a sample was skipped before the epoch's end"
        assert len(seen) >= n - (last - 1) - last * ((b if not policy else policy // last) - 1)
    else:
        assert set(seen) == set(order), "a sample was never seen"
        assert len(seen) - n < max(worlds), "padding repeats more than one world's remainder"


def test_after_a_world_size_change_the_position_resumes_exactly_in_the_new_world():
    """4 ranks read 2 batches each, 3 ranks resume (re-sharded) and read 1; a checkpoint of
    that resumes in the 3-rank world exactly where it stopped (same world: torchdata's path)."""
    state = _take(_world(4, N, 12), 2)[1]  # global batch 12: 3 a rank on 4 ranks, 4 on 3
    three = _world(3, N, 12)
    for loader in three:
        loader.load_state_dict(state)
    expected = [[b.tolist() for b in l] for l in _world_loaded(3, state)]
    first = [next(iter(l)).tolist() for l in three]
    states = [l.state_dict() for l in three]
    assert [s["consumed"] for s in states] == [24 + 12] * 3 and [s["start"] for s in states] == [24] * 3
    for r, st_ in enumerate(states):
        again = _world(3, N, 12)[r]
        again.load_state_dict(st_)
        again.set_epoch(again.epoch)
        if len(expected[r]) == 1:  # that was epoch 0's last batch for 3 ranks: the resume starts epoch 1
            fresh = _world(3, N, 12)[r]
            fresh.set_epoch(1)
            assert again.epoch == 1 and [b.tolist() for b in again] == [b.tolist() for b in fresh]
            continue
        assert [first[r]] + [b.tolist() for b in again] == expected[r]
    rank0 = expected[0]
    assert [i for b in rank0 for i in b] == _order(0)[24:][0::3][: len(rank0) * 4]


def _world_loaded(world, state):
    loaders = _world(world, N, 12)
    for loader in loaders:
        loader.load_state_dict(state)
        loader.set_epoch(loader.epoch)
    return loaders


def test_global_batch_policy_keeps_the_samples_per_step():
    assert [len(next(iter(l))) for l in _world(4, N, 12)] == [3] * 4
    assert [len(next(iter(l))) for l in _world(3, N, 12)] == [4] * 3
    assert _world(2, N, 12)[0].global_batch_size == 12


@pytest.mark.parametrize("kw, match", [
    (dict(batch_size=None), "give exactly one"),
    (dict(global_batch_size=8), "give exactly one"),
    (dict(batch_size=None, global_batch_size=9, world_size=2), r"global_batch_size=9\) does not divide among world_size=2"),
    (dict(batch_size=None, global_batch_size=0), r"global_batch_size=0\) must be an integer >= 1"),
])
def test_batch_policy_arguments_are_checked(kw, match):
    args = dict(batch_size=2, rank=0, world_size=1) | kw
    with pytest.raises(ValueError, match=match):
        stateful_dataloader(list(range(8)), **args)


def test_set_epoch_to_another_epoch_discards_the_restored_position(caplog):
    loader = _loader()
    loader.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    again = _loader()
    again.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="ray_train_tpu.data"):
        again.set_epoch(1)
    assert "discards the position restored in epoch 0" in caplog.text
    again_epoch1 = [b.tolist() for b in again]
    assert again_epoch1 == _epochs(_loader(), 2)[6:]


def test_rank_and_world_default_to_one_process_without_distributed():
    loader = stateful_dataloader(list(range(8)), batch_size=2)
    assert isinstance(loader, ShardedStatefulDataLoader)
    assert sorted(i for b in _epochs(loader, 1) for i in b) == list(range(8))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(batch_size=0), r"batch_size=0\) must be an integer >= 1"),
        (dict(rank=1, world_size=None), "both rank and world_size"),
        (dict(rank=2, world_size=2), r"rank must be an integer in 0..world_size-1"),
        (dict(sampler=[0]), "do not pass sampler"),
    ],
)
def test_bad_arguments_name_the_field(kw, match):
    args = dict(batch_size=2, rank=0, world_size=1)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        stateful_dataloader(list(range(8)), **args)


def test_batches_are_tensors_of_the_dataset():
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(8, 1))
    loader = stateful_dataloader(data, batch_size=4, shuffle=False, rank=0, world_size=1)
    (batch,) = next(iter(loader))
    assert batch.shape == (4, 1)


def test_iterating_never_draws_from_the_global_rng():
    loader = _loader()
    before = torch.get_rng_state()
    _epochs(loader, 2)
    assert torch.equal(before, torch.get_rng_state())


def test_resumed_iterator_draws_the_same_base_seed():
    """Worker processes are seeded from the iterator's base seed."""
    loader = _loader()
    _epochs(loader, 1)
    loader.set_epoch(1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = it._base_seed
    again = _loader()
    again.load_state_dict(state)
    again.set_epoch(again.epoch)
    assert iter(again)._base_seed == expected


def test_a_state_saved_after_a_restore_but_before_the_first_batch_keeps_the_position():
    """torchdata's sampler applies a loaded position only once its generator starts."""
    loader = _loader()
    loader.set_epoch(0)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(2)]
    again = _loader()
    again.load_state_dict(loader.state_dict())
    again.set_epoch(0)
    iter(again)  # an iterator, and no batch read from it
    third = _loader()
    third.load_state_dict(again.state_dict())
    third.set_epoch(0)
    assert first + [b.tolist() for b in third] == _epochs(_loader(), 1)


def test_the_epoch_after_a_world_size_change_is_whole():
    """The re-sharding position belongs to the epoch it was saved in; the next epoch
    is the whole data set again, sharded over the new world."""
    state = _take(_world(3, N, 6), 2)[1]  # 3 ranks, 2 batches of 2: 12 samples of epoch 0
    loaders = _world(2, N, 6)
    for loader in loaders:
        loader.load_state_dict(state)
    rest = [[i for b in _epochs(l, 1) for i in b] for l in loaders]  # the rest of epoch 0
    assert sorted(rest[0] + rest[1]) == sorted(_order(0)[12:12 + 2 * len(rest[0])])
    epoch1 = [[i for b in _epochs(l, 2, start=1) for i in b] for l in loaders]
    assert len(set(epoch1[0] + epoch1[1])) == 2 * (N // 2 // 3 * 3)  # whole batches of 3 on each rank
    assert epoch1 == [[i for b in _epochs(l, 2, start=1) for i in b] for l in _world(2, N, 6)]


# --- sharding by the strategy's data-parallel ranks ---------------------------

@pytest.fixture
def fake_rank_3_of_4(monkeypatch):
    """Rank 3 of a 4-rank job on torch's fake process group, no strategy yet."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ray_train_tpu import prepare
    from ray_train_tpu.strategies import base

    monkeypatch.setattr(base, "_active", None)
    monkeypatch.setattr(prepare, "_context", None)
    dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


def _tp2():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from ray_train_tpu.strategies import FSDP2TPStrategy

    return FSDP2TPStrategy(tp_size=2, plan={"0": ColwiseParallel()})


def _shard(loader):
    return loader.sampler.rank, loader.sampler.num_replicas


def test_without_a_mesh_the_loader_shards_by_the_process_group(fake_rank_3_of_4):
    assert _shard(stateful_dataloader(list(range(16)), batch_size=2)) == (3, 4)


@pytest.mark.parametrize("where", ["setup", "trainer_context"])
def test_tensor_parallel_peers_share_a_shard(fake_rank_3_of_4, where):
    """fsdp2+tp with tp_size=2 on 4 ranks: rank 3 is data-parallel rank 1 of 2,
    after the strategy built its mesh, and before that inside a TPUTorchTrainer
    worker (the loader is often built before prepare_model)."""
    from ray_train_tpu import prepare

    strategy = _tp2()
    if where == "setup":
        strategy.setup("cpu", 4)
    else:
        prepare.set_context(prepare.StrategyContext(strategy=strategy))
    assert prepare.data_parallel_shard() == (1, 2)
    loader = stateful_dataloader(list(range(16)), global_batch_size=4, shuffle=False)
    assert _shard(loader) == (1, 2) and loader.batch_size == 2
    assert [b.tolist() for b in loader] == [[1, 3], [5, 7], [9, 11], [13, 15]]


def test_an_explicit_rank_that_contradicts_the_mesh_is_refused(fake_rank_3_of_4):
    _tp2().setup("cpu", 4)
    with pytest.raises(ValueError, match=(
            r"stateful_dataloader\(rank=3, world_size=4\) contradicts the job's device mesh: this process is "
            r"data-parallel rank 1 of 2.*pass rank=1, world_size=2")):
        stateful_dataloader(list(range(16)), batch_size=2, rank=3, world_size=4)
    assert _shard(stateful_dataloader(list(range(16)), batch_size=2, rank=1, world_size=2)) == (1, 2)


@pytest.mark.parametrize("world", [2, 4, 1])
def test_a_state_saved_on_an_epochs_last_step_resumes_at_the_next_epoch(world):
    """Saved after the last batch but before the iterator noticed the end: resumed in the same
    world or another, the loader starts the next epoch (it yielded nothing before: a loop over
    it that did not advance the epoch spun without steps)."""
    data = torch.utils.data.TensorDataset(torch.arange(12.0))

    def loader(w, rank=0):
        return stateful_dataloader(data, global_batch_size=4, seed=1, rank=rank, world_size=w)

    first = loader(2)
    first.set_epoch(0)
    it = iter(first)
    for _ in range(len(first)):
        next(it)
    state = first.state_dict()
    assert state["epoch"] == 0 and not state["loader"]["_iterator_finished"]  # the case: not noticed yet
    whole = [x[0] for r in range(world) for x in (lambda l: (l.set_epoch(1), list(l))[1])(loader(world, r))]
    resumed = [loader(world, r) for r in range(world)]
    for r, l in enumerate(resumed):
        l.load_state_dict(state)
        assert l.epoch == 1
        l.set_epoch(l.epoch)
    got = [x[0] for l in resumed for x in l]
    assert len(got) == len(whole) > 0 and all(torch.equal(a, b) for a, b in zip(got, whole))
