"""GRPO's formulas, each against a hand computation, and the trainer's update
loop against a plain one-process loop of the same formulas."""

import dataclasses
import doctest
import math

import pytest
import torch

from ray_train_tpu.rl import config, data, grpo, rewards, tasks, weights
from ray_train_tpu.testing import gloo
from ray_train_tpu.rl.grpo import (aggregate, build_batch, group_advantages, importance_weights, kl_penalty,
                                   minibatches, policy_loss, token_logprobs)


@pytest.mark.parametrize("module", [grpo, config, data, tasks, weights, rewards])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_group_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([[1.0, 0.0, 0.2, 0.2], [0.0, 0.0, 0.0, 1.0]])
    a = group_advantages(r)
    assert torch.allclose(a.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(a.std(dim=1, unbiased=False), torch.ones(2), atol=1e-3)
    assert a[0, 0] > a[0, 2] > a[0, 1]
    assert torch.equal(group_advantages(torch.full((1, 4), 0.2)), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="samples_per_prompt"):
        group_advantages(torch.ones(4))


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


def _one_token(lp, old, adv, **kw):
    """policy_loss of one row whose only completion token has log-probs lp (old: old)."""
    return policy_loss(torch.tensor([[0.0, lp]]), torch.tensor([[0.0, old]]), torch.tensor([adv]),
                       torch.tensor([[0.0, 1.0]]), num_tokens=1, **kw)


@pytest.mark.parametrize("ratio, adv, clip_high, loss, clipped", [
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


ALGOS = [
    dict(ppo_epochs=2, num_minibatches=2, clip_eps_high=0.28),
    dict(ppo_epochs=1, num_minibatches=2, old_logprobs="engine", loss_agg="seq-mean-token-mean"),
    dict(ppo_epochs=1, num_minibatches=1, kl_coef=0.05, kl_estimator="k1", micro_batch_size=3),
]


def test_policy_worker_update_equals_a_plain_loop(tiny_model):
    """PolicyWorker.train (FSDP2 over one rank, on the simulated TPU device: the
    batch arrives as host tensors, as from the object store) ends with the same
    weights as a plain host loop over the same minibatches with the module's
    formulas, for each algorithm setting."""
    assert gloo.run(_update_equals_a_plain_loop, 1, tiny_model, ALGOS, simulate_tpu=True, timeout_s=240) == [
        len(ALGOS)]


def _update_equals_a_plain_loop(rank, world_size, tiny_model, algos):
    for algo in algos:
        _one_update_equals_a_plain_loop(tiny_model, algo)
    return len(algos)


def _one_update_equals_a_plain_loop(tiny_model, algo):
    from transformers import AutoModelForCausalLM

    from ray_train_tpu.rl.config import AlgorithmConfig
    from ray_train_tpu.rl.policy import PolicyWorker
    from ray_train_tpu.rl.temperature import tempered_logprobs

    a = AlgorithmConfig(**algo)
    worker = PolicyWorker(tiny_model, lr=1e-2, seed=3, algorithm=a, temperature=0.7)
    worker.build()
    batch = _batch()
    stats = worker.train(batch, step=1)
    assert stats["updates"] == a.updates_per_batch and math.isfinite(stats["loss"])

    # The plain loop runs on the same device (its kernels, not the host's: Adam
    # turns a last-bit difference in a near-zero gradient into a visible one).
    device = worker.device
    batch = batch.to(device)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to(device)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).requires_grad_(False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    def lp_of(m, rows):
        return token_logprobs(m(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits, rows.input_ids,
                              0.7)

    with torch.no_grad():
        # engine log-probs are of the raw logits (vllm-torchtpu): the sampler's at T = 0.7 (rl.temperature)
        batch = dataclasses.replace(batch, engine_logprobs=tempered_logprobs(
            batch.engine_logprobs, model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, 0.7,
            batch.loss_mask))
        old_all = batch.engine_logprobs if a.old_logprobs == "engine" else lp_of(model, batch)
        ref_all = lp_of(ref, batch)
    for epoch in range(a.ppo_epochs):
        for parts in minibatches(batch.num_rows, 1, a.num_minibatches, seed=3 * 7919 + 1, epoch=epoch):
            idx = parts[0]
            rows = batch.rows(idx)
            lp = lp_of(model, rows)
            old = old_all[idx]
            w = importance_weights(old, rows.engine_logprobs, a.importance_cap) if a.old_logprobs == "policy" else None
            loss, _ = policy_loss(lp, old, rows.advantages, rows.loss_mask, num_tokens=int(rows.loss_mask.sum()),
                                  num_seqs=len(idx), clip_low=a.clip_eps, clip_high=a.clip_high, loss_agg=a.loss_agg,
                                  weights=w, ref_logprobs=ref_all[idx] if a.kl_coef else None, kl_coef=a.kl_coef,
                                  kl_estimator=a.kl_estimator)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    ours = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in worker.model.named_parameters()}
    for name, p in model.named_parameters():
        # Bitwise, except where micro-batches sum the gradient in another order.
        atol = 1e-5 if algo.get("micro_batch_size") else 0.0
        assert torch.allclose(ours[name].detach().cpu(), p.detach().cpu(), rtol=0.0, atol=atol), (algo, name)


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
