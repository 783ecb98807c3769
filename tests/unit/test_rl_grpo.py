"""GRPO's pure parts: tasks and rewards, advantages, the loss, weight parity (torch only)."""

import doctest

import pytest
import torch

from ray_train_tpu.rl import grpo, tasks, weights
from ray_train_tpu.rl.grpo import build_batch, group_advantages, grpo_loss, token_logprobs
from ray_train_tpu.rl.tasks import Prompt, addition_task, chat_addition_task, strict_answer_reward
from ray_train_tpu.rl.weights import digest, hf_names, mismatches, split_digests


@pytest.mark.parametrize("module", [grpo, tasks, weights])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_prompts_are_deterministic_per_step_and_seed():
    task = addition_task(max_operand=9)
    assert task.prompts(3, 16, seed=1) == task.prompts(3, 16, seed=1)
    assert task.prompts(3, 16, seed=1) != task.prompts(4, 16, seed=1)
    assert task.prompts(3, 16, seed=1) != task.prompts(3, 16, seed=2)
    for p in task.prompts(1, 50, seed=0):
        a, b = p.text.rstrip("=").split("+")
        assert int(p.answer) == int(a) + int(b) and 0 <= int(a) <= 9


def test_chat_task_uses_the_template():
    task = chat_addition_task(lambda m: f"<user>{m}</user>", max_operand=3)
    p = task.prompts(1, 1, seed=0)[0]
    assert p.text.startswith("<user>What is ") and p.text.endswith("Reply with only the number.</user>")


@pytest.mark.parametrize("completion, reward", [
    ("7", 1.0), (" 7\n", 1.0), ("7+", 0.5), ("The answer is 7.", 0.5), ("7 + 0 = 7", 0.5), ("8", 0.0), ("-7", 0.0),
    ("71", 0.0), ("3 + 4 = 7", 0.0), ("seven", 0.0), ("", 0.0),
])
def test_strict_answer_reward(completion, reward):
    assert strict_answer_reward(Prompt("3+4=", "7"), completion) == reward


def test_task_rejects_bad_operand_range():
    with pytest.raises(ValueError, match="max_operand"):
        addition_task(max_operand=0)


def test_group_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([[1.0, 0.0, 0.2, 0.2], [0.0, 0.0, 0.0, 1.0]])
    a = group_advantages(r)
    assert torch.allclose(a.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(a.std(dim=1, unbiased=False), torch.ones(2), atol=1e-3)
    assert a[0, 0] > a[0, 2] > a[0, 1]
    assert torch.equal(group_advantages(torch.full((1, 4), 0.2)), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="samples_per_prompt"):
        group_advantages(torch.ones(4))


def test_build_batch_masks_only_completion_tokens():
    b = build_batch([[1, 2, 3], [4]], [[5], [6, 7, 8]], [0.5, -0.5], pad_id=0, completion_logprobs=[[-1.0], [-2, -3, -4]])
    assert b.input_ids.tolist() == [[1, 2, 3, 5], [4, 6, 7, 8]]
    assert b.loss_mask.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1]]
    assert b.engine_logprobs.tolist() == [[0, 0, 0, -1], [0, -2, -3, -4]]
    assert b.num_completion_tokens == 4
    half = b.rows(slice(1, None, 2))
    assert half.input_ids.tolist() == [[4, 6, 7, 8]] and half.advantages.tolist() == [-0.5]
    with pytest.raises(ValueError, match="as many"):
        build_batch([[1]], [[2], [3]], [1.0], pad_id=0)


def test_token_logprobs_match_log_softmax():
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    lp = token_logprobs(logits, ids)
    want = torch.log_softmax(logits, -1)[0, 2, ids[0, 3]]
    assert torch.allclose(lp[0, 3], want) and lp[:, 0].abs().sum() == 0


def test_loss_gradient_raises_logprob_of_positive_advantage_samples():
    """A few steps on the GRPO loss make the better sample likelier: the direction is right."""
    torch.manual_seed(0)
    logits = torch.zeros(2, 2, 3, requires_grad=True)  # 2 rows, prompt token + 1 completion token
    ids = torch.tensor([[0, 1], [0, 2]])
    mask = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    opt = torch.optim.SGD([logits], lr=1.0)
    for _ in range(3):
        lp = token_logprobs(logits, ids)
        loss = grpo_loss(lp, lp.detach(), adv, mask, num_tokens=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    p = torch.softmax(logits[0, 0], -1)
    assert p[1] > 0.5 > p[2]


def test_loss_clips_large_ratios():
    lp, old = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 0.0]])  # ratio e at the completion token
    loss = grpo_loss(lp, old, torch.tensor([1.0]), torch.tensor([[0.0, 1.0]]), num_tokens=1, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2)


def test_sharded_loss_sums_to_the_whole_batch_loss():
    """Rows split over ranks, scaled by world size, then averaged = the whole batch's token mean."""
    torch.manual_seed(0)
    lp = torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    adv = torch.randn(4)
    n = int(mask.sum())
    whole = grpo_loss(lp, lp, adv, mask, n)
    world = 2
    parts = [grpo_loss(lp[r::world], lp[r::world], adv[r::world], mask[r::world], n) * world for r in range(world)]
    assert torch.allclose(sum(parts) / world, whole)


def test_split_digests_matches_the_trainers_shards_of_a_fused_tensor():
    """What the trainer's ranks hash (their dim-0 shards of q, k, v) is what the engine
    hashes after cutting its fused qkv tensor with the layout it was sent."""
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 3), torch.randn(2, 3), torch.randn(2, 3)
    world = 2
    trainer = {}
    layout = {}
    for name, t in (("m.q_proj.weight", q), ("m.k_proj.weight", k), ("m.v_proj.weight", v)):
        shards = list(torch.chunk(t, world))  # FSDP2's dim-0 sharding
        layout[name] = [s.shape[0] for s in shards]
        trainer.update({f"{name}#{r}": digest(s) for r, s in enumerate(shards)})
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    fused = torch.cat([q, k, v])
    assert split_digests("m.qkv_proj.weight", fused, packed, layout) == trainer
    wrong = fused.clone()
    wrong[6, 1] += 1.0  # inside k's shard 1 ... row 6 = k row 1
    bad = mismatches(trainer, split_digests("m.qkv_proj.weight", wrong, packed, layout))
    assert bad == ["m.k_proj.weight#1: digest differs"]
    assert hf_names("m.o_proj.weight", packed) == ["m.o_proj.weight"]
    with pytest.raises(KeyError, match="no counterpart"):
        split_digests("other.weight", torch.ones(1), packed, layout)


def test_digest_is_bitwise_and_dtype_aware():
    t = torch.randn(5, dtype=torch.float32)
    assert digest(t) == digest(t.clone())
    u = t.clone()
    u[2] = torch.nextafter(u[2], torch.tensor(10.0))  # one ulp
    assert digest(u) != digest(t)
    assert digest(t.to(torch.bfloat16)) != digest(t)
    assert digest(torch.tensor([-0.0])) == digest(torch.tensor([0.0]))
    assert mismatches({"a": digest(t)}, {"a": digest(u)}) == ["a: digest differs"]


def test_rl_demo_rejects_bad_input_before_starting_anything():
    import io

    from ray_train_tpu.cli import main

    for argv, message in ((["--steps", "0"], "--steps must be >= 1"), (["--samples", "1"], "--samples must be >= 2"),
                          (["--temperature", "0"], "--temperature must be > 0")):
        err = io.StringIO()
        assert main(["rl-demo", *argv], out=io.StringIO(), err=err) == 2
        assert message in err.getvalue()


def test_grpo_config_names_the_bad_field(tmp_path):
    from ray_train_tpu.rl.loop import GRPOConfig
    from ray_train_tpu.rl.rollout import SamplingConfig

    with pytest.raises(ValueError, match="num_prompts"):
        GRPOConfig(model_dir=str(tmp_path), num_prompts=0)
    with pytest.raises(ValueError, match="model_dir"):
        GRPOConfig(model_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="engine_dtype"):
        GRPOConfig(model_dir=str(tmp_path), engine_dtype="int8")
    with pytest.raises(ValueError, match="n=1"):
        SamplingConfig(n=1)


def test_cli_and_package_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, ray_train_tpu.rl, ray_train_tpu.rl.cli, ray_train_tpu.cli; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _fake_history(n):
    return [{"step": i + 1, "reward_mean": 0.1 * i, "reward_std": 0.05, "reward_min": 0.0, "reward_max": 1.0,
             "exact": 0.05 * i, "rollout_s": 0.2, "reward_s": 0.001, "train_s": 0.3, "checkpoint_s": 0.0,
             "sync_s": 0.05, "parity_s": 0.01, "step_s": 0.6, "parity_checked": True, "rollout_retries": i == 2,
             "resumed_from": 5 if i == 3 else None, "prompt": "1+2=", "sample": "3"} for i in range(n)]


def test_rl_demo_output_is_labelled_and_summarised(tmp_path):
    from ray_train_tpu.rl.cli import format_step, plot, summary

    history = _fake_history(8)
    lines = [format_step(m) for m in history]
    assert all(line.startswith("[SIMULATED] step") for line in lines)
    assert "reward 0.100 ± 0.050" in lines[1] and "parity OK" in lines[1]
    assert "retried" in lines[2] and "resumed from step 5" in lines[3]
    s = summary(history)
    assert s["reward_first5"] == pytest.approx(0.2) and s["reward_last5"] == pytest.approx(0.5)
    assert s["sync_fraction_of_step"] == pytest.approx(0.05 / 0.6)
    plot(history, tmp_path / "curve.png", "test")
    assert (tmp_path / "curve.png").stat().st_size > 1000
