"""RL's data, rewards, weight buckets and parity blocks, engine layouts,
one-slice halves (against Ray's own subslice code) and bad input: no cluster."""

import types

import pytest
import torch

from ray_train_tpu.rl import step as S
from ray_train_tpu.rl.config import AlgorithmConfig, GRPOConfig, SamplingConfig
from ray_train_tpu.rl.data import PromptSource, renderer
from ray_train_tpu.rl.rewards import RewardError, check_reward, score_chunk
from ray_train_tpu.rl.tasks import (addition_records, final_number, gsm8k_reward, strict_answer_reward,
                                    word_problem_records)
from ray_train_tpu.rl.weights import (assemble, block_slices, digest, engine_digests, mismatches, pack, plan_buckets,
                                      trainer_digests, unpack)

# --- prompts -------------------------------------------------------------------------


def test_every_record_is_drawn_once_per_epoch_in_a_seeded_order():
    recs = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(10)]
    src = PromptSource(recs, seed=3)
    first_epoch = [r["answer"] for k in (1, 2) for r in src.step_records(k, 5)]
    assert sorted(first_epoch) == [str(i) for i in range(10)]
    assert src.step_records(3, 5) != src.step_records(1, 5)  # a new epoch, a new order
    assert PromptSource(recs, seed=3).step_records(2, 5) == src.step_records(2, 5)  # a restart draws the same
    assert PromptSource(recs, seed=4).step_records(1, 5) != src.step_records(1, 5)
    assert len(PromptSource(iter(recs), seed=0)) == 10  # a generator is read once


def test_a_hugging_face_style_dataset_is_indexed_in_place():
    class Dataset:  # what datasets.Dataset offers: len() and integer indexing, no Sequence ABC
        __module__ = "datasets.arrow_dataset"
        reads = 0

        def __len__(self):
            return 4

        def __getitem__(self, i):
            Dataset.reads += 1
            return {"question": f"q{i}", "answer": str(i)}

    src = PromptSource(Dataset(), seed=0, prompt_key="question")
    assert [r["question"] for r in src.step_records(1, 2)] and Dataset.reads <= 3  # no copy of the whole dataset
    assert src.fields({"question": "q", "answer": "1"}) == {"answer": "1"}


@pytest.mark.parametrize("prompts, match, error", [
    ([], "at least one record", ValueError),
    ([{"text": "1+1="}], "field 'prompt'", TypeError),
    (["1+1="], "must be a mapping", TypeError),
    ([{"prompt": ""}], "non-empty string or a list of chat messages", TypeError),
    ([{"prompt": [{"role": "user"}]}], "non-empty string or a list of chat messages", TypeError),
])
def test_bad_records_are_refused_naming_the_rule(prompts, match, error):
    with pytest.raises(error, match=match):
        PromptSource(prompts, seed=0)


def test_chat_templates_apply_when_the_tokenizer_has_one():
    tok = types.SimpleNamespace(name_or_path="m", chat_template="{{x}}", apply_chat_template=lambda msgs, **kw:
                                "|".join(f"{m['role']}:{m['content']}" for m in msgs) + "|assistant:")
    assert renderer(tok, None)("2+2?") == "user:2+2?|assistant:"
    assert renderer(tok, False)("2+2?") == "2+2?"
    assert renderer(tok, False)([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == \
        "system:s|user:u|assistant:"
    plain = types.SimpleNamespace(name_or_path="tiny", chat_template=None)
    assert renderer(plain, None)("1+1=") == "1+1="
    with pytest.raises(ValueError, match="no chat template"):
        renderer(plain, True)
    with pytest.raises(ValueError, match="no chat template"):
        renderer(plain, None)([{"role": "user", "content": "x"}])


def _fake_loop(**config):
    from ray_train_tpu.rl.models import _tokenizer

    recs = config.pop("prompts", addition_records(8, max_operand=9))
    cfg = types.SimpleNamespace(**{**dict(num_prompts=4, seed=0, prompt_key="prompt", reward_workers=2,
                                          reward_timeout_s=5, sampling=SamplingConfig(n=2, max_tokens=3),
                                          on_reward_error="raise"), **config})
    tok = _tokenizer()
    return types.SimpleNamespace(config=cfg, source=PromptSource(recs, seed=0), tokenizer=tok, render=lambda p: p,
                                 max_model_len=8, reward_ref=None)


def test_prompts_too_long_for_the_context_are_skipped_and_counted(caplog):
    loop = _fake_loop(prompts=[{"prompt": "1+1=", "answer": "2"}, {"prompt": "11111+1=", "answer": "0"}] * 2)
    prepared = S.prepare(loop, step=1)
    assert prepared.skipped_too_long == 2 and len(prepared.requests) == 2
    assert "does not fit the engine's context" in caplog.text
    loop = _fake_loop(prompts=[{"prompt": "11111+1=", "answer": "0"}])
    with pytest.raises(ValueError, match="max_model_len=8"):
        S.prepare(loop, step=1)


# --- rewards -------------------------------------------------------------------------


def test_reward_results_say_what_is_wrong():
    def fn(prompt, completion, answer):
        return {"ok": 1.0, "nan": float("nan"), "inf": float("inf"), "str": "1", "none": None,
                "np": __import__("numpy").float32(0.5)}.get(completion) if completion != "boom" else 1 / 0

    got = score_chunk(fn, [("p", c, {"answer": "1"}) for c in ("ok", "nan", "inf", "str", "none", "np", "boom")])
    assert got[0] == (1.0, None) and got[5] == (0.5, None)
    assert [why.split(" ")[1] for _, why in got[1:5]] == ["nan", "inf", "'1'", "None"]
    assert got[6][0] is None and "raised ZeroDivisionError" in got[6][1]
    assert check_reward(True)[0] is None  # a bool is a verdict, not a reward


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_failing_reward_stops_the_run_or_skips_its_group(monkeypatch, policy):
    def fn(prompt, completion, answer):
        if prompt == "1+1=":
            raise KeyError("no such answer")
        return float(completion == answer)

    monkeypatch.setattr(S, "compute_rewards", lambda ref, items, **kw: score_chunk(fn, items))
    loop = _fake_loop(prompts=[{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+2=", "answer": "3"}],
                      on_reward_error=policy)
    prepared = S.prepare(loop, step=1)
    samples = [[{"text": "2", "token_ids": [5]}, {"text": "3", "token_ids": [6]}] for _ in prepared.records]
    if policy == "raise":
        with pytest.raises(RewardError, match=r"raised KeyError: 'no such answer'.*prompt '1\+1='"):
            S.rewards(loop, prepared, samples)
        return
    kept, values, counts = S.rewards(loop, prepared, samples)
    assert [prepared.records[g]["prompt"] for g in kept] == ["1+2="] * len(kept)
    assert counts["reward_errors"] == 2 * counts["prompts_skipped_reward"] > 0
    loop.source = PromptSource([{"prompt": "1+1=", "answer": "2"}], seed=0)
    prepared = S.prepare(loop, step=1)
    with pytest.raises(RewardError, match="every prompt"):
        S.rewards(loop, prepared, [samples[0]] * len(prepared.records))


def test_ready_made_rewards():
    assert [strict_answer_reward("3+4=", c, answer="7") for c in ("7", " 7\n", "7+", "8", "-7", "71")] == \
        [1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    rec = word_problem_records(1, seed=1)[0]
    n = rec["answer"].split("#### ")[1]
    assert gsm8k_reward(rec["question"], f"So it is {n}.", answer=rec["answer"]) == 1.0
    assert gsm8k_reward(rec["question"], "#### 1,000", answer="x\n#### 1000") == 1.0
    assert gsm8k_reward(rec["question"], "no idea", answer=rec["answer"]) == 0.0
    assert final_number("a 3 b 4.") == "4"


# --- weights: buckets and parity blocks ---------------------------------------------


def test_buckets_round_trip_bit_for_bit_and_shards_reassemble():
    torch.manual_seed(0)
    full = {"a": torch.randn(5, 3).bfloat16(), "b": torch.randn(4).float(), "c": torch.randn(3, 2).half()}
    shards = [{n: t.chunk(2)[r] for n, t in full.items()} for r in range(2)]
    buckets = [pack(s.items()) for s in shards]
    assert [digest(t) for _, t in unpack(buckets[0])] == [digest(t) for t in shards[0].values()]
    tensors, layout = assemble(buckets)
    assert {n: digest(t) for n, t in tensors} == {n: digest(t) for n, t in full.items()}
    assert layout == {"a": [3, 2], "b": [2, 2], "c": [2, 1]}
    assert plan_buckets([("x", 10)] * 5, bucket_bytes=25) == [["x", "x"], ["x", "x"], ["x"]]
    assert plan_buckets([("big", 100), ("x", 1)], bucket_bytes=10) == [["big"], ["x"]]


def test_block_slices_by_hand():
    # rows 1..3 of a tensor split 2 + 2 over shards: shard 0 row 1, shard 1 rows 0-1
    assert block_slices((0, 1, 3), [2, 2]) == [(0, (slice(0, 1),), (slice(1, 2),)),
                                               (1, (slice(1, 3),), (slice(0, 2),))]
    assert block_slices((1, 2, 2), [1, 2]) == [(0, (slice(0, 1),), (slice(0, 1), slice(2, 4))),
                                               (1, (slice(1, 3),), (slice(0, 2), slice(2, 4)))]
    assert block_slices(None, [1, 2]) == [(0, (slice(0, 1),), (slice(0, 1),)), (1, (slice(1, 3),), (slice(0, 2),))]


def _tp_engine_tensors(q, k, v, o, tp, rank):
    """What vLLM's TP rank holds: rows of q, k, v (fused) and columns of o."""
    rq, rk = q.shape[0] // tp, k.shape[0] // tp
    qkv = torch.cat([q[rank * rq:(rank + 1) * rq], k[rank * rk:(rank + 1) * rk], v[rank * rk:(rank + 1) * rk]])
    ro = o.shape[1] // tp
    specs = {"m.qkv_proj.weight": [(0, rank * rq, rq), (0, rank * rk, rk), (0, rank * rk, rk)],
             "m.o_proj.weight": [(1, rank * ro, ro)]}
    return {"m.qkv_proj.weight": qkv, "m.o_proj.weight": o[:, rank * ro:(rank + 1) * ro]}, specs


def test_trainer_and_tp_engine_blocks_match_and_a_flipped_weight_is_found():
    torch.manual_seed(0)
    full = {"m.q_proj.weight": torch.randn(8, 4), "m.k_proj.weight": torch.randn(4, 4),
            "m.v_proj.weight": torch.randn(4, 4), "m.o_proj.weight": torch.randn(4, 8)}
    world, tp = 3, 2  # uneven FSDP2 shards: 8 rows as 3 + 3 + 2, 4 rows as 2 + 2 + 0

    def fsdp_shard(t, r):  # torch.chunk, with an empty shard for a rank past the chunks (as FSDP2 pads)
        chunks = t.chunk(world)
        return chunks[r] if r < len(chunks) else t[:0]

    shards = [{n: fsdp_shard(t, r) for n, t in full.items()} for r in range(world)]
    layout = {n: [s[n].shape[0] for s in shards] for n in full}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    engine, specs = {}, {}
    for rank in range(tp):
        tensors, per_name = _tp_engine_tensors(*(full[f"m.{x}_proj.weight"] for x in "qkvo"), tp=tp, rank=rank)
        for name, t in tensors.items():
            engine.update(engine_digests(name, t, per_name[name], rank, packed, layout))
        names = {"m.qkv_proj.weight": ["m.q_proj.weight", "m.k_proj.weight", "m.v_proj.weight"],
                 "m.o_proj.weight": ["m.o_proj.weight"]}
        for fused, pieces in names.items():
            for piece, spec in zip(pieces, per_name[fused]):
                specs.setdefault(piece, []).append(spec)
    trainer = {}
    for r in range(world):
        trainer.update(trainer_digests(r, shards[r], layout, specs))
    assert trainer and not mismatches(trainer, engine)
    shards[1]["m.o_proj.weight"][0, 5] += 1.0  # rank 1's first row of o, column 5: in TP rank 1's columns
    trainer = {k: v for r in range(world) for k, v in trainer_digests(r, shards[r], layout, specs).items()}
    assert mismatches(trainer, engine) == ["m.o_proj.weight#1@tp1: digest differs"]


def test_without_tp_the_blocks_are_the_trainer_shards():
    t = torch.arange(12.0).view(6, 2)
    layout = {"w": [3, 3]}
    engine = engine_digests("w", t, [None], None, {}, layout)
    trainer = {**trainer_digests(0, {"w": t[:3]}, layout), **trainer_digests(1, {"w": t[3:]}, layout)}
    assert engine == trainer and sorted(engine) == ["w#0", "w#1"]
    with pytest.raises(KeyError, match="no counterpart"):
        engine_digests("other.weight", t, [None], None, {}, layout)


def test_digest_is_bitwise_and_dtype_aware():
    t = torch.randn(5, dtype=torch.float32)
    u = t.clone()
    u[2] = torch.nextafter(u[2], torch.tensor(10.0))  # one ulp
    assert digest(t) == digest(t.clone()) and digest(u) != digest(t)
    assert digest(t.to(torch.bfloat16)) != digest(t)
    assert digest(torch.tensor([-0.0])) == digest(torch.tensor([0.0]))


# --- engines and slices --------------------------------------------------------------


def test_engine_layouts_must_fill_the_slice():
    from ray_train_tpu.rl.rollout import EngineLayout
    from ray_train_tpu.topology import Topology

    t = Topology.parse("2x2x2", "TPU-V4")
    assert list(EngineLayout(topology=t, num_engines=2, tensor_parallel_size=4).devices(1)) == [4, 5, 6, 7]
    EngineLayout(topology=t, num_engines=1, tensor_parallel_size=8)  # across both hosts
    with pytest.raises(ValueError, match=r"3 x 2 = 6 does not fill .* 8 devices.*8 x 1, 4 x 2, 2 x 4, 1 x 8"):
        EngineLayout(topology=t, num_engines=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="part of one host or whole hosts"):
        EngineLayout(topology=Topology.parse("4x4x12", "TPU-V4"), num_engines=32, tensor_parallel_size=6)


def test_a_model_whose_heads_do_not_split_is_refused():
    from ray_train_tpu.rl.rollout import check_model_fits
    from ray_train_tpu.serve.spec import ModelShape

    check_model_fits(ModelShape(num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=2), 4, "m")
    with pytest.raises(ValueError, match="tensor_parallel_size=4.*2 attention heads"):
        check_model_fits(ModelShape(num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2), 4, "m")


@pytest.mark.parametrize("topology, accel, half", [("2x2x2", "TPU-V4", "2x2x1"), ("2x2x4", "TPU-V4", "2x2x2"),
                                                   ("4x8", "TPU-V6E", "4x4")])
def test_half_of_a_slice(topology, accel, half):
    from ray_train_tpu.rl.slices import half_topology
    from ray_train_tpu.topology import Topology

    assert half_topology(Topology.parse(topology, accel)).name == half


@pytest.mark.parametrize("topology, accel, match", [("2x2x1", "TPU-V4", "1 host"), ("2x4", "TPU-V6E", "1 host"),
                                                    ("4x4", "TPU-V6E", "2x4 sub-slices of 2 hosts")])
def test_a_slice_that_cannot_be_halved_is_refused_by_name(topology, accel, match):
    from ray_train_tpu.rl.slices import half_topology
    from ray_train_tpu.topology import Topology

    with pytest.raises(ValueError, match=match):
        half_topology(Topology.parse(topology, accel))


@pytest.mark.parametrize("topology, accel", [("2x2x2", "TPU-V4"), ("2x2x4", "TPU-V4"), ("4x4", "TPU-V6E"),
                                             ("4x8", "TPU-V6E"), ("4x4x4", "TPU-V4")])
def test_simulated_coordinates_give_ray_every_host_and_two_halves_that_are_boxes(monkeypatch, topology, accel):
    """Ray's own subslice code (_get_physical_worker_id_from_coords, _build_subslice_labels)
    tells the simulated hosts apart and cuts the slice into two halves, each a box
    of chips in the slice's mesh (Ray numbers hosts along the last dimension
    first, torch_tpu along the first: the numbers differ, the halves must not)."""
    from ray._private.accelerators.tpu import (TPU_SUBSLICE_LABEL_PREFIX, _build_subslice_labels,
                                               _get_physical_worker_id_from_coords)

    from ray_train_tpu import constants as C
    from ray_train_tpu.rl.slices import half_topology, simulated_chip_coords
    from ray_train_tpu.topology import Topology

    t = Topology.parse(topology, accel)
    half = half_topology(t) if (t.name, accel) != ("4x4", "TPU-V6E") else Topology.parse("2x2", "TPU-V6E")
    ray_half = "2x4" if (t.name, accel) == ("4x4", "TPU-V6E") else half.name
    physical, halves = [], {}
    for w in range(t.num_hosts):
        for k, v in {C.TPU_WORKER_ID: str(w), C.TPU_TOPOLOGY: t.name, C.TPU_ACCELERATOR_TYPE: t.pod_type}.items():
            monkeypatch.setenv(k, v)
        coords = [c[2] for c in simulated_chip_coords()]
        physical.append(_get_physical_worker_id_from_coords(coords, t.name))
        label = _build_subslice_labels(physical[-1], t.name)[TPU_SUBSLICE_LABEL_PREFIX + ray_half]
        halves.setdefault(label, []).append(w)
    assert sorted(physical) == list(range(t.num_hosts))
    assert sorted(halves) == ["0", "1"]
    for hosts in halves.values():
        chips = [t.chip_coords(w, i) for w in hosts for i in range(t.chips_per_host)]
        box = [max(c[d] for c in chips) - min(c[d] for c in chips) + 1 for d in range(3)]
        assert box[0] * box[1] * box[2] == len(chips) == t.num_chips // 2, (hosts, box)


# --- configuration -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_prompts=0), "num_prompts"),
    (dict(engine_dtype="int8"), "engine_dtype"),
    (dict(prompts=None), "prompts"),
    (dict(prompts="1+1="), "prompts"),
    (dict(reward_fn=None), "reward_fn"),
    (dict(num_engines=0), "num_engines"),
    (dict(on_reward_error="ignore"), "on_reward_error"),
    (dict(lr=0), "lr"),
    (dict(engine_kwargs={"tensor_parallel_size": 2}), "engine_kwargs"),
    (dict(engine_kwargs={"enforce_eager": True}), r"engine_kwargs\) sets \['enforce_eager'\].*always run eager"),
    (dict(algorithm=AlgorithmConfig(), sampling=None), "sampling"),
])
def test_grpo_config_names_the_bad_field(tmp_path, kwargs, match):
    base = dict(model_dir=str(tmp_path), prompts=[{"prompt": "1+1="}], reward_fn=strict_answer_reward)
    with pytest.raises((ValueError, TypeError), match=match):
        GRPOConfig(**{**base, **kwargs})
    with pytest.raises(ValueError, match="model_dir"):
        GRPOConfig(**{**base, "model_dir": str(tmp_path / "missing")})


@pytest.mark.parametrize("kwargs, match", [
    (dict(ppo_epochs=0), "ppo_epochs"), (dict(old_logprobs="ref"), "old_logprobs"),
    (dict(importance_cap=0.5), "importance_cap"), (dict(clip_eps=0), "clip_eps"), (dict(clip_eps=1.5), "clip_eps"),
    (dict(loss_agg="sum"), "loss_agg"), (dict(kl_coef=-1), "kl_coef"), (dict(kl_in="advantage"), "kl_in"),
    (dict(micro_batch_size=0), "micro_batch_size"),
])
def test_algorithm_config_names_the_bad_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AlgorithmConfig(**kwargs)
    with pytest.raises(ValueError, match="n=1"):
        SamplingConfig(n=1)


def test_a_run_removes_the_checkpoint_directory_it_made_unless_asked(tmp_path):
    from ray_train_tpu.rl.loop import GRPOLoop
    from ray_train_tpu.rl.models import tiny_addition_model

    base = dict(model_dir=tiny_addition_model(str(tmp_path)), prompts=addition_records(4),
                reward_fn=strict_answer_reward)
    for keep, failed, kept in ((False, False, False), (True, False, True), (False, True, True)):
        loop = GRPOLoop(GRPOConfig(**base, keep_checkpoints=keep))
        loop._failed = failed
        assert loop.checkpoint_root.is_dir()
        (loop.checkpoint_root / "step_000005").mkdir()  # a checkpoint written (an empty directory goes anyway)
        loop.shutdown()
        assert loop.checkpoint_root.exists() == kept, (keep, failed)
    mine = tmp_path / "mine"
    mine.mkdir()
    loop = GRPOLoop(GRPOConfig(**base, checkpoint_dir=str(mine)))
    loop.shutdown()
    assert mine.is_dir()  # a directory the user gave is theirs


def test_a_real_hugging_face_dataset_and_a_gsm8k_style_reward():
    import datasets  # the rl extra, which make test installs: never skipped
    ds = datasets.Dataset.from_list(word_problem_records(6, seed=2))
    src = PromptSource(ds, seed=0, prompt_key="question")
    assert src.records is ds and len(src) == 6
    rec = src.step_records(1, 1)[0]
    assert rec["question"].endswith("?") and gsm8k_reward(rec["question"], rec["answer"], **src.fields(rec)) == 1.0
