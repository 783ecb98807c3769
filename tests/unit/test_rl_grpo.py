"""GRPO's formulas, each against a hand computation, and the trainer's update
loop against a plain one-process loop of the same formulas."""

import doctest
import math
import re

import pytest
import torch

from ray_train_tpu.rl import config, data, grpo, rewards, tasks, temperature, weights
from ray_train_tpu.rl.config import AlgorithmConfig
from ray_train_tpu.testing import gloo
from ray_train_tpu.rl.grpo import (aggregate, build_batch, group_advantages, importance_weights, kl_penalty,
                                   minibatches, policy_loss, token_logprobs)


@pytest.mark.parametrize("module", [grpo, config, data, tasks, weights, rewards, temperature])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_group_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([[1.0, 0.0, 0.2, 0.2], [0.0, 0.0, 0.0, 1.0]])
    a = group_advantages(r)
    assert torch.allclose(a.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(a.std(dim=1, unbiased=True), torch.ones(2), atol=1e-5)
    assert a[0, 0] > a[0, 2] > a[0, 1]
    assert torch.equal(group_advantages(torch.full((1, 4), 0.2)), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="samples_per_prompt"):
        group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="std='bessel'"):
        group_advantages(r, std="bessel")


def test_group_advantages_by_hand_sample_population_and_no_std():
    # rewards 1, 0, 0, 1: mean 1/2, deviations +-1/2; sum of squares 1.
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    sample, population = math.sqrt(1 / 3), math.sqrt(1 / 4)  # verl / TRL: torch.std (Bessel); the old: 1/G
    assert group_advantages(r)[0].tolist() == pytest.approx([0.5 / (sample + 1e-6) * s for s in (1, -1, -1, 1)],
                                                            abs=1e-12)
    assert group_advantages(r, std="population")[0, 0].item() == pytest.approx(0.5 / (population + 1e-6), abs=1e-12)
    assert group_advantages(r, std="none")[0].tolist() == [0.5, -0.5, -0.5, 0.5]  # Dr. GRPO: centred only
    assert group_advantages(r, eps=1e-4)[0, 0].item() == pytest.approx(0.5 / (sample + 1e-4), abs=1e-12)  # TRL's eps


def test_build_batch_masks_only_completion_tokens_and_pads_to_a_multiple():
    b = build_batch([[1, 2, 3], [4]], [[5], [6, 7, 8]], [0.5, -0.5], pad_id=0, completion_logprobs=[[-1.0], [-2, -3, -4]])
    assert b.input_ids.tolist() == [[1, 2, 3, 5], [4, 6, 7, 8]]
    assert b.loss_mask.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1]]
    assert b.engine_logprobs.tolist() == [[0, 0, 0, -1], [0, -2, -3, -4]]
    assert b.num_completion_tokens == 4
    p = b.padded(3, pad_id=0)
    assert p.num_rows == 3 and p.loss_mask[2].sum() == 0 and p.attention_mask[2].tolist() == [1, 0, 0, 0]
    assert p.num_completion_tokens == 4 and p.advantages.tolist() == [0.5, -0.5, 0.0]
    assert b.padded(2, pad_id=0) is b
    with pytest.raises(ValueError, match="as many"):
        build_batch([[1]], [[2], [3]], [1.0], pad_id=0)


def test_token_logprobs_use_the_sampling_temperature():
    # logits (0, ln 3): p = (1/4, 3/4); at temperature 2: logits (0, ln 3 / 2), p1 = sqrt3 / (1 + sqrt3)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1]])
    assert token_logprobs(logits, ids)[0, 1].exp().item() == pytest.approx(0.75)
    assert token_logprobs(logits, ids, temperature=2.0)[0, 1].exp().item() == pytest.approx(
        math.sqrt(3) / (1 + math.sqrt(3)))
    assert token_logprobs(logits, ids)[0, 0] == 0


def _head(dtype, rows=3, width=17, hidden=16, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, hidden, generator=g, dtype=dtype)
    w, b = torch.randn(vocab, hidden, generator=g, dtype=dtype) / 4, torch.randn(vocab, generator=g, dtype=dtype)
    return h, w, b, torch.randint(0, vocab, (rows, width), generator=g)


def test_chunked_token_logprobs_equal_the_full_logits_path_to_1e_6():
    """float32 values: chunks of 7 tokens (not dividing the 3 x 16 positions) against
    log_softmax of the whole [B, T, V] logits."""
    h, w, b, ids = _head(torch.float32)
    full = token_logprobs(h @ w.T + b, ids, 0.7)
    for chunk in (7, 48, 1000):
        got = grpo.chunked_token_logprobs(h, w, ids, 0.7, bias=b, chunk_size=chunk)
        assert got.dtype == torch.float32 and got.shape == full.shape and (got[:, 0] == 0).all()
        assert (got - full).abs().max().item() < 1e-6, chunk
    with pytest.raises(ValueError, match="chunk_size=0"):
        grpo.chunked_token_logprobs(h, w, ids, chunk_size=0)


def test_chunked_token_logprobs_backward_equals_autograd_of_the_full_path_in_float64():
    """The hand-written backward (recomputing each chunk) against torch's autograd of
    the full path, and torch.autograd.gradcheck's finite differences."""
    h, w, b, ids = _head(torch.float64)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (h, w, b)]
    got = torch.autograd.grad((grpo.chunked_token_logprobs(inputs[0], inputs[1], ids, 0.7, bias=inputs[2],
                                                           chunk_size=7) * weights).sum(), inputs)
    want = torch.autograd.grad((token_logprobs(inputs[0] @ inputs[1].T + inputs[2], ids, 0.7) * weights).sum(),
                               inputs)
    for x, y in zip(got, want):
        assert (x - y).abs().max().item() <= 1e-12 * max(1.0, y.abs().max().item())
    small = [t[..., :5].clone().requires_grad_() if i != 2 else t[:11].clone().requires_grad_()
             for i, t in enumerate((h[:2, :4, :5], w[:11, :5], b))]
    assert torch.autograd.gradcheck(lambda hh, ww, bb: grpo.chunked_token_logprobs(
        hh, ww, ids[:2, :4] % 11, 1.3, bias=bb, chunk_size=2), small)


def test_removed_v1_names_say_what_replaces_them():
    import ray_train_tpu.rl as rl

    for name, replacement in (("Task", "GRPOConfig(prompts="), ("Prompt", "a record"),
                              ("addition_task", "addition_records()")):
        with pytest.raises(ImportError, match=rf"ray_train_tpu.rl.{name} was removed.*{re.escape(replacement)}"):
            exec(f"from ray_train_tpu.rl import {name}")
    with pytest.raises(ImportError, match="removed"):
        rl.Task
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        rl.Nothing


def test_algorithm_config_numeric_fields_refuse_bad_values():
    with pytest.raises(ValueError, match=r"AlgorithmConfig\(clip_ratio_c=1.0\) must be > 1.*clip_ratio_c=3.0"):
        AlgorithmConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"AlgorithmConfig\(logprob_chunk=0\)"):
        AlgorithmConfig(logprob_chunk=0)
    assert AlgorithmConfig().clip_ratio_c == 3.0 and AlgorithmConfig(clip_ratio_c=None).clip_ratio_c is None


def _one_token(lp, old, adv, **kw):
    """policy_loss of one row whose only completion token has log-probs lp (old: old)."""
    return policy_loss(torch.tensor([[0.0, lp]]), torch.tensor([[0.0, old]]), torch.tensor([adv]),
                       torch.tensor([[0.0, 1.0]]), num_tokens=1, **kw)


@pytest.mark.parametrize("ratio, adv, clip_high, loss, clipped", [
    (4.0, -1.0, None, 3.0, 0.0),      # dual clip: min(max(4, 0.8) = 4, clip_ratio_c = 3) = 3
    (1.5, 1.0, None, -1.2, 1.0),      # min(1.5, 1.2) = 1.2: clipped above
    (1.5, -1.0, None, 1.5, 0.0),      # min(-1.5, -1.2) = -1.5: a bad sample's ratio is not clipped
    (0.5, -1.0, None, 0.8, 1.0),      # min(-0.5, -0.8) = -0.8: clipped below
    (0.5, 1.0, None, -0.5, 0.0),
    (1.5, 1.0, 0.28, -1.28, 1.0),     # clip-higher: up to 1 + 0.28
    (1.25, 1.0, 0.28, -1.25, 0.0),    # inside [0.8, 1.28]: not clipped (it would be with 0.2)
])
def test_clipped_surrogate_by_hand(ratio, adv, clip_high, loss, clipped):
    got, stats = _one_token(math.log(ratio), 0.0, adv, clip_low=0.2, clip_high=clip_high)
    assert got.item() == pytest.approx(loss, abs=1e-6)
    assert stats["clipfrac"].item() == clipped


def test_token_mean_and_sequence_mean_by_hand():
    # ratio 1: the per-token loss is -A. Row 0: 1 token (A=1), row 1: 3 tokens (A=2).
    lp = torch.zeros(2, 4)
    mask = torch.tensor([[0, 1.0, 0, 0], [0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, 2.0])
    tok, _ = policy_loss(lp, lp, adv, mask, num_tokens=4, num_seqs=2, loss_agg="token-mean")
    seq, _ = policy_loss(lp, lp, adv, mask, num_tokens=4, num_seqs=2, loss_agg="seq-mean-token-mean")
    assert tok.item() == pytest.approx(-(1 + 2 + 2 + 2) / 4)
    assert seq.item() == pytest.approx(-(1 + 2) / 2)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(lp, mask, "seq-sum", 4, 2)


@pytest.mark.parametrize("log_ratio, adv, c, loss, low, high, dual", [
    # A < 0, ratio 4 > c = 3: the loss is bounded at 3 |A| (verl's pg_clipfrac_lower counts it)
    (math.log(4.0), -1.0, 3.0, 3.0, 0.0, 0.0, 1.0),
    (math.log(4.0), -2.0, 3.0, 6.0, 0.0, 0.0, 1.0),
    (math.log(4.0), -1.0, None, 4.0, 0.0, 0.0, 0.0),      # no dual clip: the ratio's own 4
    (math.log(2.5), -1.0, 3.0, 2.5, 0.0, 0.0, 0.0),       # below c: untouched
    (math.log(4.0), 1.0, 3.0, -1.2, 0.0, 1.0, 0.0),       # A > 0: the ordinary clip at 1 + 0.2, high side
    (math.log(0.5), -1.0, 3.0, 0.8, 1.0, 0.0, 0.0),       # A < 0, ratio below 1 - 0.2: low side
    # log-ratio 30 is clamped to 20 (verl): without the dual clip the loss is e^20, not e^30
    (30.0, -1.0, None, math.exp(20.0), 0.0, 0.0, 0.0),
    (30.0, -1.0, 3.0, 3.0, 0.0, 0.0, 1.0),
])
def test_dual_clip_log_ratio_clamp_and_clip_sides_by_hand(log_ratio, adv, c, loss, low, high, dual):
    got, st = _one_token(log_ratio, 0.0, adv, clip_low=0.2, clip_ratio_c=c)
    assert got.item() == pytest.approx(loss, rel=1e-6)
    assert (st["clipfrac_low"].item(), st["clipfrac_high"].item(), st["clipfrac_dual"].item()) == (low, high, dual)
    assert st["clipfrac"].item() == low + high  # verl's pg_clipfrac: either side


def test_dual_clip_and_clamp_stop_the_gradient_by_hand():
    # Bounded tokens carry no gradient: dual-clipped (A < 0, ratio 4 > 3), log-ratio past 20.
    for lp0, adv, c in ((math.log(4.0), -1.0, 3.0), (30.0, -1.0, None), (math.log(2.5), -1.0, 3.0)):
        lp = torch.tensor([[0.0, lp0]], requires_grad=True)
        loss, _ = policy_loss(lp, torch.zeros(1, 2), torch.tensor([adv]), torch.tensor([[0.0, 1.0]]), num_tokens=1,
                              clip_ratio_c=c)
        loss.backward()
        want = 0.0 if lp0 in (math.log(4.0), 30.0) else -adv * 2.5  # d(-A e^x)/dx = -A ratio
        assert lp.grad[0, 1].item() == pytest.approx(want, rel=1e-6), (lp0, adv, c)


def test_ratio_statistics_and_approx_kl_by_hand():
    # Three completion tokens with ratios 2, 1/2, 1 (and a masked one with ratio e^5).
    lp = torch.tensor([[0.0, math.log(2.0), math.log(0.5), 0.0, 5.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    _, st = policy_loss(lp, torch.zeros(1, 5), torch.tensor([1.0]), mask, num_tokens=3)
    assert st["ratio_mean"].item() == pytest.approx((2 + 0.5 + 1) / 3)
    assert (st["ratio_min"].item(), st["ratio_max"].item()) == pytest.approx((0.5, 2.0))
    assert st["approx_kl"].item() == pytest.approx(-(math.log(2.0) + math.log(0.5)) / 3, abs=1e-7)  # mean(old - new)
    assert st["clipfrac_high"].item() == pytest.approx(1 / 3)  # ratio 2 > 1.2 with A > 0
    _, none = policy_loss(lp, torch.zeros(1, 5), torch.tensor([1.0]), torch.zeros(1, 5), num_tokens=0)
    assert (none["ratio_min"].item(), none["ratio_max"].item()) == (math.inf, -math.inf)


def test_importance_weight_is_truncated_and_scales_the_surrogate():
    w = importance_weights(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), cap=2.0)
    assert w.tolist() == pytest.approx([2.0, math.exp(-1)])  # e^1 capped at 2; e^-1
    got, _ = _one_token(0.0, 0.0, 1.0, weights=torch.tensor([[1.0, 0.5]]))
    assert got.item() == pytest.approx(-0.5)


def test_kl_estimators_and_kl_as_a_loss_term_by_hand():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-1) + 1 - 1)
    assert kl_penalty(ref, ref, "k3").item() == 0.0
    # verl's low_var_kl clamps: the log-ratio to [-20, 20], the estimate to [-10, 10]
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "k3").item() == pytest.approx(
        min(math.exp(-20.0) + 20.0 - 1.0, 10.0))  # 19 -> 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0  # e^20 - 21 -> 10
    assert kl_penalty(torch.tensor([-2.0]), torch.tensor([0.0]), "k3").item() == pytest.approx(math.exp(2) - 3)  # inside
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k2")
    # ratio 1, A = 1, k1 = 1 at the completion token, beta 0.1: -1 + 0.1
    got, stats = policy_loss(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -1.0]]), torch.tensor([1.0]),
                             torch.tensor([[0.0, 1.0]]), num_tokens=1, ref_logprobs=torch.tensor([[0.0, -2.0]]),
                             kl_coef=0.1, kl_estimator="k1")
    assert got.item() == pytest.approx(-0.9) and stats["kl"].item() == pytest.approx(1.0)


def test_kl_in_the_reward_by_hand():
    from ray_train_tpu.rl.step import gather_rows, kl_adjusted

    assert kl_adjusted([[1.0, 0.0], [0.5, 0.5]], [0.2, 0.4, 1.0, 0.0], coef=0.5, n=2) == [[0.9, -0.2], [0.0, 0.5]]
    assert gather_rows([[10, 12], [11, 13]], 4) == [10, 11, 12, 13]


def test_loss_gradient_raises_logprob_of_positive_advantage_samples():
    logits = torch.zeros(2, 2, 3, requires_grad=True)  # 2 rows, prompt token + 1 completion token
    ids = torch.tensor([[0, 1], [0, 2]])
    mask = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    opt = torch.optim.SGD([logits], lr=1.0)
    for _ in range(3):
        lp = token_logprobs(logits, ids)
        loss, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]), mask, num_tokens=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    p = torch.softmax(logits[0, 0], -1)
    assert p[1] > 0.5 > p[2]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ranks_losses_times_world_size_average_to_the_whole_minibatch(agg):
    torch.manual_seed(0)
    lp, old = torch.randn(4, 6), torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    adv = torch.randn(4)
    n_tok, n_seq = int(mask.sum()), 4
    whole, _ = policy_loss(lp, old, adv, mask, num_tokens=n_tok, num_seqs=n_seq, loss_agg=agg)
    world = 2
    parts = [policy_loss(lp[r::world], old[r::world], adv[r::world], mask[r::world], num_tokens=n_tok,
                         num_seqs=n_seq, loss_agg=agg)[0] * world for r in range(world)]
    assert torch.allclose(sum(parts) / world, whole)


def test_minibatches_cover_every_row_once_per_epoch_and_keep_rows_on_their_rank():
    world, m, rows = 4, 2, 16
    for epoch in range(3):
        parts = minibatches(rows, world, m, seed=5, epoch=epoch)
        assert len(parts) == m and all(len(p) == world for p in parts)
        flat = sorted(r for p in parts for rank_rows in p for r in rank_rows)
        assert flat == list(range(rows))
        assert all(r % world == rank for p in parts for rank, rank_rows in enumerate(p) for r in rank_rows)
        assert all(len(rank_rows) == rows // world // m for p in parts for rank_rows in p)
    assert minibatches(rows, world, m, seed=5, epoch=0) == minibatches(rows, world, m, seed=5, epoch=0)
    assert minibatches(rows, world, m, seed=5, epoch=0) != minibatches(rows, world, m, seed=5, epoch=1)
    with pytest.raises(ValueError, match="pad the batch"):
        minibatches(10, 4, 2, seed=0, epoch=0)


# --- the trainer's update loop against a plain loop -----------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ray_train_tpu.rl.models import tiny_addition_model

    return tiny_addition_model(str(tmp_path_factory.mktemp("models")))


def _batch(seed=0, rows=8):
    g = torch.Generator().manual_seed(seed)
    prompts = [[int(x) for x in torch.randint(4, 14, (3,), generator=g)] for _ in range(rows)]
    completions = [[int(x) for x in torch.randint(4, 14, (2,), generator=g)] for _ in range(rows)]
    logprobs = [[-2.0 - 0.1 * i, -2.5] for i in range(rows)]
    adv = torch.randn(rows, generator=g).tolist()
    return build_batch(prompts, completions, adv, pad_id=0, completion_logprobs=logprobs)


ALGOS = [  # the chunked log-prob head in chunks of 7 tokens (several per micro-batch) and the naive path
    dict(ppo_epochs=2, num_minibatches=2, clip_eps_high=0.28, logprob_chunk=7),
    dict(ppo_epochs=1, num_minibatches=2, old_logprobs="engine", loss_agg="seq-mean-token-mean", logprob_chunk=None,
         clip_ratio_c=None),
    dict(ppo_epochs=1, num_minibatches=1, kl_coef=0.05, kl_estimator="k1", micro_batch_size=3),
]
MICRO = dict(ppo_epochs=1, num_minibatches=1, kl_coef=0.05, kl_estimator="k3", micro_batch_size=3)


@pytest.fixture(scope="module")
def update_runs(tiny_model):
    """One spawned rank runs every comparison below (a spawn costs seconds)."""
    return gloo.run(_update_runs, 1, tiny_model, ALGOS, MICRO, simulate_tpu=True, timeout_s=240)[0]


def test_policy_worker_update_equals_a_plain_loop(update_runs):
    """PolicyWorker.train (FSDP2 over one rank, on the simulated TPU device: the
    batch arrives as host tensors, as from the object store) ends with bitwise the
    same float32 weights as a plain host loop of the module's formulas over the same
    minibatches and micro-batches, in the same order, for each algorithm setting.

    Bitwise, because every sum runs in the same order on the same kernels: a fixed
    tolerance after AdamW would not do (Adam turns a last-bit gradient difference
    near zero into a visible weight difference; on an Intel Xeon a micro-batched
    sum compared with a whole-minibatch one moved a weight by 1.27e-5). That the
    micro-batches add up to the whole minibatch's gradient is checked in float64
    below, before the optimizer."""
    assert [r["algo"] for r in update_runs["float32"]] == ALGOS
    for r in update_runs["float32"]:
        assert r["updates"] == AlgorithmConfig(**r["algo"]).updates_per_batch and math.isfinite(r["loss"])
        assert r["differing"] == [], r
        assert r["chunked"] == bool(AlgorithmConfig(**r["algo"]).logprob_chunk)  # the head it was told to use


def test_policy_worker_reports_verls_statistics_per_ppo_epoch(update_runs):
    """Per PPO epoch (2 epochs x 2 minibatches): clip fractions by side, ratio
    mean/min/max, approx KL; the first minibatch of epoch 1 starts at ratio 1."""
    from ray_train_tpu.rl.policy import _SUMMED

    assert _SUMMED[1:-2] == grpo.ADDITIVE_STATS
    st = update_runs["float32"][0]["stats"]
    assert len(st["epochs"]) == 2
    for e in st["epochs"]:
        assert set(e) >= {"clipfrac", "clipfrac_low", "clipfrac_high", "clipfrac_dual", "ratio_mean", "ratio_min",
                          "ratio_max", "approx_kl", "loss", "grad_norm"}
        assert 0 < e["ratio_min"] <= e["ratio_mean"] <= e["ratio_max"]
        assert e["clipfrac"] == pytest.approx(e["clipfrac_low"] + e["clipfrac_high"], abs=1e-6)
    # The policy moves within the batch: epoch 2's ratios leave 1 further than epoch 1's.
    first, second = st["epochs"]
    assert second["ratio_max"] - second["ratio_min"] > first["ratio_max"] - first["ratio_min"] > 0
    assert st["ratio_min"] == min(first["ratio_min"], second["ratio_min"])
    assert st["clipfrac"] == pytest.approx((first["clipfrac"] + second["clipfrac"]) / 2)


def test_micro_batch_gradients_add_up_to_the_minibatch_gradient_in_float64(update_runs):
    """The trainer's gradient accumulated over micro-batches of 3 rows (k3 KL in the
    loss, importance weights) against one backward over the whole minibatch, both in
    float64, compared before the optimizer (what AdamW receives, after the clip).

    The two differ only by the order of floating-point sums. A reordered sum of n
    terms moves by at most about 2 n u sum|x_i| (Higham, Accuracy and Stability of
    Numerical Algorithms, 4.2), u = 2^-53 in float64. Here n = the minibatch's
    positions x the widest layer (the longest reduction of the backward, 10,240),
    and each parameter's largest gradient entry max|g| stands for sum|x_i|:
    tolerance 2 n u max|g| = 2.3e-12 max|g|, per parameter (measured: the largest
    difference is ~2e-4 of it). The negative control - each micro-batch normalised
    by its own token count instead of the minibatch's, a real accumulation defect -
    is off by ~1e11 times the tolerance."""
    r = update_runs["float64"]
    print(f"float64 micro-batches: bound {r['bound_rel']:.3g} x max|g|, largest diff / bound {r['diff_over_bound']:.3g}, "
          f"defect / bound {r['defect_over_bound']:.3g}")
    assert r["max_abs_grad"] > 1e-3  # a real gradient, not zeros
    assert r["bound_rel"] < 1e-11, r["bound_rel"]
    assert r["differing"] == [], r["differing"]
    assert r["defect_over_bound"] > 1e3, r["defect_over_bound"]


def _update_runs(rank, world_size, tiny_model, algos, micro):
    return {"float32": [_float32_update_equals_a_plain_loop(tiny_model, algo) for algo in algos],
            "float64": _float64_micro_batches_equal_the_minibatch(tiny_model, micro)}


def _chunks(index, size):
    size = size or len(index)
    return [index[i:i + size] for i in range(0, len(index), size)]


def _plain_loop(tiny_model, a, batch, device, *, dtype, micro, normalise_per_chunk=False):
    """The update of `PolicyWorker.train` written out with the module's formulas on a
    plain model: scoring in chunks of ``micro`` rows, then per minibatch the
    micro-batches' gradients accumulated by backward, clipped, one AdamW step.
    Returns the model and the gradients AdamW received at each step."""
    from transformers import AutoModelForCausalLM

    from ray_train_tpu.rl.temperature import engine_logprobs_at_temperature

    batch = batch.to(device)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype).to(device)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype).requires_grad_(False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    single = a.updates_per_batch == 1 and a.old_logprobs == "policy"

    def lp_of(m, rows):
        if a.logprob_chunk:  # the backbone's hidden states through the LM head, in chunks
            hidden = m.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).last_hidden_state
            return grpo.chunked_token_logprobs(hidden, m.lm_head.weight, rows.input_ids, 0.7, bias=m.lm_head.bias,
                                               chunk_size=a.logprob_chunk)
        return token_logprobs(m(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits, rows.input_ids,
                              0.7)

    every = list(range(batch.num_rows))
    # engine log-probs are of the raw logits (vllm-torchtpu): the sampler's at T = 0.7 (rl.temperature)
    batch = engine_logprobs_at_temperature(model, batch, 0.7, a.micro_batch_size,
                                           head=model.lm_head if a.logprob_chunk else None, chunk_size=a.logprob_chunk)
    with torch.no_grad():
        old_all = None
        if a.old_logprobs == "engine":
            old_all = batch.engine_logprobs
        elif not single:
            old_all = torch.cat([lp_of(model, batch.rows(c)) for c in _chunks(every, micro)])
        ref_all = torch.cat([lp_of(ref, batch.rows(c)) for c in _chunks(every, micro)]) if a.kl_coef else None
    grads = []
    for epoch in range(a.ppo_epochs):
        for parts in minibatches(batch.num_rows, 1, a.num_minibatches, seed=3 * 7919 + 1, epoch=epoch):
            idx = parts[0]
            opt.zero_grad()
            for c in _chunks(idx, micro):
                rows = batch.rows(c)
                lp = lp_of(model, rows)
                old = lp.detach() if single else old_all[c]
                w = importance_weights(old, rows.engine_logprobs, a.importance_cap) if a.old_logprobs == "policy" \
                    else None
                n_tok = int(rows.loss_mask.sum()) if normalise_per_chunk else int(batch.loss_mask[idx].sum())
                n_seq = len(c) if normalise_per_chunk else len(idx)
                loss, _ = policy_loss(lp, old, rows.advantages, rows.loss_mask, num_tokens=n_tok, num_seqs=n_seq,
                                      clip_low=a.clip_eps, clip_high=a.clip_high, clip_ratio_c=a.clip_ratio_c,
                                      loss_agg=a.loss_agg, weights=w,
                                      ref_logprobs=ref_all[c] if a.kl_coef else None, kl_coef=a.kl_coef,
                                      kl_estimator=a.kl_estimator)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()})
            opt.step()
    return model, grads


def _worker(tiny_model, a, dtype="float32"):
    from ray_train_tpu.rl.policy import PolicyWorker

    worker = PolicyWorker(tiny_model, lr=1e-2, seed=3, algorithm=a, temperature=0.7, param_dtype=dtype)
    worker.build()
    grads, names = [], {id(p): n for n, p in worker.model.named_parameters()}

    def record(opt, args, kwargs):  # what AdamW receives, after the clip
        grads.append({names[id(p)]: _full(p.grad).detach().cpu().clone() for group in opt.param_groups
                      for p in group["params"]})

    worker.optimizer.register_step_pre_hook(record)
    return worker, grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _float32_update_equals_a_plain_loop(tiny_model, algo):
    a = AlgorithmConfig(**algo)
    worker, _ = _worker(tiny_model, a)
    stats = worker.train(_batch(), step=1)
    model, _ = _plain_loop(tiny_model, a, _batch(), worker.device, dtype=torch.float32, micro=a.micro_batch_size)
    ours = {n: _full(p).detach().cpu() for n, p in worker.model.named_parameters()}
    differing = [n for n, p in model.named_parameters() if not torch.equal(ours[n], p.detach().cpu())]
    return {"algo": algo, "updates": stats["updates"], "loss": stats["loss"], "differing": differing,
            "chunked": bool(worker._heads), "stats": stats}


def _float64_micro_batches_equal_the_minibatch(tiny_model, algo):
    from transformers import AutoConfig

    a = AlgorithmConfig(**algo)
    worker, got = _worker(tiny_model, a, dtype="float64")
    worker.train(_batch(), step=1)
    (got,) = got
    _, (want,) = _plain_loop(tiny_model, a, _batch(), worker.device, dtype=torch.float64, micro=None)
    _, (bad,) = _plain_loop(tiny_model, a, _batch(), worker.device, dtype=torch.float64, micro=a.micro_batch_size,
                            normalise_per_chunk=True)
    cfg = AutoConfig.from_pretrained(tiny_model)
    n = _batch().input_ids.numel() * max(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)
    rel = 2 * n * torch.finfo(torch.float64).eps / 2
    differing, defect, worst = [], 0.0, 0.0
    for name, g in want.items():
        bound = rel * g.abs().max().item()
        diff = (got[name] - g).abs().max().item()
        if diff > bound:
            differing.append((name, diff, bound))
        if bound > 0:
            worst = max(worst, diff / bound)
            defect = max(defect, (bad[name] - g).abs().max().item() / bound)
    return {"differing": differing, "bound_rel": rel, "defect_over_bound": defect, "diff_over_bound": worst,
            "max_abs_grad": max(g.abs().max().item() for g in want.values())}


def test_kl_in_the_reward_is_scored_before_the_update_and_reused(tiny_model):
    """With kl_in="reward", score() returns each row's summed KL to the reference (as
    computed by hand from the two models), and train() reuses those log-probs."""
    assert gloo.run(_kl_in_the_reward, 1, tiny_model, simulate_tpu=True, timeout_s=240) == [True]


def _kl_in_the_reward(rank, world_size, tiny_model):
    from transformers import AutoModelForCausalLM

    from ray_train_tpu.rl.config import AlgorithmConfig
    from ray_train_tpu.rl.policy import PolicyWorker

    a = AlgorithmConfig(kl_coef=0.1, kl_in="reward", kl_estimator="k3", num_minibatches=2)
    worker = PolicyWorker(tiny_model, lr=1e-2, seed=3, algorithm=a)
    worker.build()
    batch = _batch(seed=1)
    kl = worker.score(batch, step=4)
    with torch.no_grad():  # at initialisation the policy is the reference: KL 0 ...
        assert kl == pytest.approx([0.0] * batch.num_rows, abs=1e-6)
    assert 4 in worker._cache
    worker.train(batch, step=4)
    assert 4 not in worker._cache  # ... and train() used (and dropped) the scored log-probs
    moved = worker.score(batch, step=5)  # after an update the policy has moved from the reference
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in worker.model.named_parameters()}
    now = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    now.load_state_dict({n: p.detach().cpu() for n, p in params.items()}, strict=False)
    with torch.no_grad():
        lp = token_logprobs(now(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
        lr = token_logprobs(ref(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
    want = (kl_penalty(lp, lr, "k3") * batch.loss_mask).sum(dim=1)
    assert moved == pytest.approx(want.tolist(), rel=1e-4, abs=1e-7) and max(moved) > 0
    return True


@pytest.mark.parametrize("std", ["sample", "population", "none"])
def test_the_step_divides_the_advantages_by_the_configured_std(std):
    import types

    from ray_train_tpu.rl import step as S

    values = [[1.0, 0.0, 0.0], [0.5, 0.5, 2.0]]  # rewards of 2 prompts x 3 samples
    algorithm = AlgorithmConfig(std=std, num_minibatches=1)
    loop = types.SimpleNamespace(pad_id=0, trainer=types.SimpleNamespace(world_size=1),
                                 config=types.SimpleNamespace(algorithm=algorithm))
    prepared = types.SimpleNamespace(prompt_ids=[[5], [6]])
    samples = [[{"token_ids": [7], "logprobs": [-0.1]}] * 3] * 2
    batch, rows = S.build(loop, prepared, samples, [0, 1], values)
    # by hand: group 1 has mean 1/3; sample std sqrt(1/3), population std sqrt(2/9)
    spread = {"sample": math.sqrt(1 / 3), "population": math.sqrt(2 / 9), "none": None}[std]
    first = (1 - 1 / 3) / (spread + 1e-6) if spread else 1 - 1 / 3
    assert rows == 6 and batch.advantages[0].item() == pytest.approx(first, rel=1e-6)
    with pytest.raises(ValueError, match=r"AlgorithmConfig\(std='unbiased'\)"):
        AlgorithmConfig(std="unbiased")


def test_the_temperature_correction_inside_the_lm_head_makes_no_full_logits_and_equals_the_naive_one():
    """rl.temperature with the model's LM head: the same corrected log-probs as from
    the model's whole logits, and no [B, T, V] tensor is made (the output of every
    torch function is recorded): at most a [chunk, V] one."""
    import types

    from torch.overrides import TorchFunctionMode

    from ray_train_tpu.rl.temperature import engine_logprobs_at_temperature

    torch.manual_seed(4)
    vocab, hidden, t = 97, 8, 0.7
    embed, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)

    def model(input_ids, attention_mask):
        return types.SimpleNamespace(logits=head(torch.tanh(embed(input_ids) * 4)))  # the head's output: the logits

    prompts, completions = [[3, 4, 5, 6], [6, 7], [8]], [[9, 10, 1], [11, 12, 13, 2, 5], [14, 15]]
    ids = build_batch(prompts, completions, [0.0] * 3, pad_id=0).input_ids
    with torch.no_grad():
        raw = token_logprobs(model(ids, None).logits, ids, 1.0)
    batch = build_batch(prompts, completions, [0.0] * 3, pad_id=0,
                        completion_logprobs=[raw[i, len(p):len(p) + len(c)].tolist()
                                             for i, (p, c) in enumerate(zip(prompts, completions))])
    shapes = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(o.shape for o in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(o, torch.Tensor))
            return out

    with Record():
        chunked = engine_logprobs_at_temperature(model, batch, t, head=head, chunk_size=4)
    naive = engine_logprobs_at_temperature(model, batch, t)
    rows, width = batch.input_ids.shape
    assert rows * width > 4 and (4, vocab) in shapes  # in chunks of 4 tokens' logits ...
    assert not [s for s in shapes if s.numel() > max(4 * vocab, head.weight.numel())]  # ... and nothing larger
    bound = 16 * torch.finfo(torch.float32).eps * (raw.abs().max().item() / t + 8.0)
    torch.testing.assert_close(chunked.engine_logprobs, naive.engine_logprobs, rtol=0, atol=bound)
    assert not hasattr(head, "__dict__") or "forward" not in head.__dict__  # the head's own forward again


# --- the trainer starts from exactly model_dir's weights --------------------------------


def _source_check(rank, world_size, model_dir):
    import torch.distributed as dist

    from ray_train_tpu.rl.policy import PolicyWorker, _local

    worker = PolicyWorker(model_dir, lr=1e-2, seed=3, algorithm=AlgorithmConfig())
    worker.build()
    rows = {n: _local(p).shape[0] for n, p in worker.model.named_parameters()}
    every = [None] * world_size
    dist.all_gather_object(every, rows)
    layout = {n: [r[n] for r in every] for n in rows}
    loaded = worker.source_mismatches(layout)
    name = "model.layers.1.mlp.down_proj.weight"
    if rank == 1:  # the second shard: its rows start after rank 0's
        with torch.no_grad():
            _local(dict(worker.model.named_parameters())[name])[0, 3] += 2.0 ** -20
    changed = worker.source_mismatches(layout)
    return {"loaded": loaded, "changed": changed, "layout": layout[name], "num": len(layout)}


def test_the_trainer_holds_model_dirs_weights_bit_for_bit_and_a_changed_bit_is_named(tiny_model):
    """`PolicyWorker.source_mismatches` (GRPOLoop.check_source at start): each of 2
    FSDP2 ranks compares its own rows of every parameter with the directory's
    safetensors; a one-ulp-sized change in rank 1's shard is named, rank 0's is clean."""
    results = gloo.run(_source_check, 2, tiny_model, simulate_tpu=True, timeout_s=240)
    assert [r["loaded"] for r in results] == [[], []] and results[0]["num"] > 5
    assert results[0]["layout"] == [64, 64]  # down_proj [128, 256] over 2 ranks
    assert results[0]["changed"] == []
    assert results[1]["changed"] == ["model.layers.1.mlp.down_proj.weight: rank 1's rows 64..127 differ"]
