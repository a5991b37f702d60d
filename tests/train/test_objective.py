"""The DFlash training objective against slow, obviously-correct constructions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafter import dflash
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.model.attention import write_rows
from specjax.model.loader import load_model
from specjax.model.target import init_kv_pages
from specjax.spec.reference import full_forward
from specjax.train.objective import block_logits, dflash_loss, labels_and_weights, sample_anchors, simulated_acceptance
from tests.helpers import adam_losses

Q = 4


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    target = load_model(tiny_dirs["qwen3"])
    cfg = drafter_config_for(target.config, num_layers=2, block_size=Q, target_layer_ids=(0, 2), mask_embedding=True)
    weights = init_drafter(cfg, jax.random.PRNGKey(1), std=0.1)
    rng = np.random.default_rng(0)
    lengths = np.array([30, 21])
    tokens = np.zeros((2, 32), np.int32)
    taps = np.zeros((2, 32, cfg.num_taps * target.config.hidden_size), np.float32)
    loss_mask = np.zeros((2, 32), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(0, 256, n)
        taps[i, :n] = np.asarray(full_forward(target.weights, target.config, list(tokens[i, :n]),
                                              cfg.hidden_state_indices)[1])
        loss_mask[i, 8:n] = True  # "prompt" = first 8 tokens
    return target, cfg, weights, tokens, taps, loss_mask, lengths


def test_anchor_sampling_respects_response_and_length(setup):
    *_, loss_mask, lengths = setup
    anchors, keep = sample_anchors(np.random.default_rng(3), loss_mask, lengths, 40, Q)
    for i in range(2):
        a = anchors[i][keep[i]]
        assert list(a) == sorted(set(a))  # sorted, without replacement
        assert all(loss_mask[i, x] and x <= lengths[i] - Q for x in a)
        assert keep[i].sum() == min(40, lengths[i] - Q + 1 - 8)


def extended(setup, slot: bool, vocab: int):
    """The setup's drafter with per-slot embeddings and / or a draft vocabulary of `vocab` ids (0 = none)."""
    target, cfg, weights, *_ = setup
    cfg = dataclasses.replace(cfg, has_slot_embedding=slot, draft_vocab_size=vocab)
    if slot:
        weights = dataclasses.replace(weights, slot_embedding=0.3 * jax.random.normal(jax.random.PRNGKey(7),
                                                                                    (Q, cfg.hidden_size)))
    ids = np.sort(np.random.default_rng(4).choice(target.config.vocab_size, vocab, replace=False)) if vocab else None
    return cfg, weights, ids


def inference_logits(target, cfg, full_weights, taps, tokens, i, a):
    """The inference drafter with context rows 0..a-1 of sequence i and bonus x[a] at position a.  Every row of the
    sequence is observed and only rows 0..a-1 are written (slot -1: dropped), so each call has the same shapes and
    its eager ops compile once, not once per anchor (a row's K/V depends on nothing but that row)."""
    w = target.weights
    dkv = init_kv_pages(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim)
    pos = jnp.arange(taps.shape[1])[None]
    slots = jnp.where(pos < a, 32 + pos, -1)
    dkv = write_rows(dkv, slots, dflash.observe(full_weights, cfg, jnp.asarray(taps[i:i + 1]), pos))
    prepared = dflash.with_draft_head(full_weights, w.vocab_rows)
    return np.asarray(dflash.propose_logits(prepared, cfg, dkv, w.embed, w.vocab_rows,
                                            jnp.asarray(tokens[i, a:a + 1]), jnp.asarray([a]), jnp.asarray([[1]]),
                                            Q - 1, Q))[0], prepared


@pytest.mark.parametrize("slot,vocab", [(False, 0), (True, 0), (True, 100)])
def test_block_logits_equal_inference_drafter_with_context_before_anchor(setup, slot, vocab):
    """Training block j == the inference drafter with context rows 0..a_j-1 and bonus x[a_j] at position a_j
    (with the specjax extensions: per-slot embeddings, a draft vocabulary)."""
    target, _, _, tokens, taps, loss_mask, lengths = setup
    cfg, weights, ids = extended(setup, slot, vocab)
    anchors, keep = sample_anchors(np.random.default_rng(5), loss_mask, lengths, 6, Q)
    keep[1, -1] = False  # a padding block must not disturb the others
    w = target.weights
    head = w.output_head if ids is None else w.output_head[:, ids]
    train = np.asarray(block_logits(weights, cfg, w.embed, head, jnp.asarray(tokens), jnp.asarray(taps),
                                    jnp.asarray(anchors), jnp.asarray(keep), Q))
    full = weights if ids is None else dataclasses.replace(weights, draft_ids=jnp.asarray(ids, jnp.int32))
    for i in range(2):
        for j in range(anchors.shape[1]):
            if not keep[i, j]:
                continue
            a = int(anchors[i, j])
            ref, _ = inference_logits(target, cfg, full, taps, tokens, i, a)
            np.testing.assert_allclose(train[i, j], ref, atol=2e-4, rtol=1e-4, err_msg=f"seq {i} anchor {a}")


def test_simulated_acceptance_equals_inference_drafts(setup):
    """Teacher-forced acceptance == leading matches of the inference drafter's drafts (mapped to target ids)."""
    target, _, _, tokens, taps, loss_mask, lengths = setup
    cfg, weights, ids = extended(setup, True, 40)
    w = target.weights
    anchors, keep = sample_anchors(np.random.default_rng(8), loss_mask, lengths, 12, Q)
    full = dataclasses.replace(weights, draft_ids=jnp.asarray(ids, jnp.int32))
    # Make the first anchor's first two drafts right and its third wrong: its drafts depend only on the taps
    # (fixed inputs here) before it and on x[a], so rewriting x[a+1..a+3] leaves them unchanged.
    tokens = tokens.copy()
    a0 = int(anchors[0, 0])
    logits, prepared = inference_logits(target, cfg, full, taps, tokens, 0, a0)
    drafts = np.asarray(dflash.to_target_ids(prepared, jnp.argmax(jnp.asarray(logits), -1)))
    tokens[0, a0 + 1:a0 + 3] = drafts[:2]
    tokens[0, a0 + 3] = (drafts[2] + 1) % 256
    t2d = -np.ones(target.config.vocab_size, np.int32)
    t2d[ids] = np.arange(len(ids))
    accepted, counted = simulated_acceptance(weights, cfg, w.embed, w.output_head[:, ids], jnp.asarray(tokens),
                                             jnp.asarray(taps), jnp.asarray(loss_mask), jnp.asarray(lengths),
                                             jnp.asarray(anchors), jnp.asarray(keep), Q, jnp.asarray(t2d))
    assert int(accepted[0, 0]) == 2
    for i in range(2):
        for j in range(anchors.shape[1]):
            assert bool(counted[i, j]) == bool(keep[i, j])
            if not keep[i, j]:
                continue
            a = int(anchors[i, j])
            logits, prepared = inference_logits(target, cfg, full, taps, tokens, i, a)
            drafts = np.asarray(dflash.to_target_ids(prepared, jnp.argmax(jnp.asarray(logits), -1)))
            n = 0
            while n < Q - 1 and drafts[n] == tokens[i, a + 1 + n]:
                n += 1
            assert int(accepted[i, j]) == n


def test_draft_vocabulary_loss_skips_labels_outside_it(setup):
    """Labels outside the draft vocabulary carry no loss and count as misses; with every label inside, the loss
    equals the cross-entropy over the restricted head computed by hand."""
    target, _, _, tokens, taps, loss_mask, lengths = setup
    cfg, weights, _ = extended(setup, False, 0)
    w = target.weights
    anchors, keep = sample_anchors(np.random.default_rng(2), loss_mask, lengths, 5, Q)
    args = (jnp.asarray(tokens), jnp.asarray(taps), jnp.asarray(loss_mask), jnp.asarray(lengths),
            jnp.asarray(anchors), jnp.asarray(keep))
    labels, wts = labels_and_weights(args[0], args[2], args[3], args[4], args[5], Q, 4.0)
    labels, wts = np.asarray(labels), np.asarray(wts)
    present = np.unique(labels[wts > 0])
    ids = np.sort(np.concatenate([present[::2], [v for v in range(300) if v not in present][:30]]))
    t2d = -np.ones(target.config.vocab_size, np.int32)
    t2d[ids] = np.arange(len(ids))
    head = w.output_head[:, ids]
    loss, aux = dflash_loss(weights, cfg, w.embed, head, *args, block_size=Q, gamma=4.0, t2d=jnp.asarray(t2d))
    logits = np.asarray(block_logits(weights, cfg, w.embed, head, args[0], args[1], args[4], args[5], Q))
    d = t2d[labels]
    inside = (wts > 0) & (d >= 0)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = logz - np.take_along_axis(logits, np.maximum(d, 0)[..., None], -1)[..., 0]
    expect = (wts * inside * ce).sum() / ((wts * inside).sum() + 1e-6)
    assert float(loss) == pytest.approx(float(expect), rel=1e-4)
    hits = (logits.argmax(-1) == d) & inside
    assert float(aux["acc"]) == pytest.approx(hits.sum() / (wts > 0).sum(), rel=1e-5)
    assert inside.sum() < (wts > 0).sum()  # some labels really were outside


def test_context_vocabulary_scores_as_a_draft_vocabulary_holding_those_ids(setup):
    """Each sequence's context ids beside the draft vocabulary (the engine's context vocabulary) give the same loss
    and simulated acceptance as a draft vocabulary that holds that sequence's ids too; labels among them are
    trained (more weighted labels), the others still skipped.  Both sequences run in one batch with different ids
    (a mixed-up batch axis would score one sequence's ids for the other)."""
    from specjax.train.objective import scored_labels

    target, _, _, tokens, taps, loss_mask, lengths = setup
    cfg, weights, _ = extended(setup, False, 0)
    w = target.weights
    anchors, keep = sample_anchors(np.random.default_rng(2), loss_mask, lengths, 8, Q)
    labels, wts = (np.asarray(a) for a in labels_and_weights(jnp.asarray(tokens), jnp.asarray(loss_mask),
                                                             jnp.asarray(lengths), jnp.asarray(anchors),
                                                             jnp.asarray(keep), Q, 4.0))
    present = np.unique(labels[wts > 0])
    ids = np.sort(np.concatenate([present[::3], [v for v in range(300) if v not in present][:30]]))
    extra = np.full((2, 6), -1, np.int32)  # up to 4 ids per sequence, its own, and empty slots
    for i in range(2):
        own = [t for t in np.unique(labels[i][wts[i] > 0]) if t not in ids][i::2][:4]
        assert own
        extra[i, :len(own)] = own
    assert set(extra[0][extra[0] >= 0]) != set(extra[1][extra[1] >= 0])

    def run(vocab, rows, more):
        t2d = -np.ones(target.config.vocab_size, np.int32)
        t2d[vocab] = np.arange(len(vocab))
        args = (jnp.asarray(tokens[rows]), jnp.asarray(taps[rows]), jnp.asarray(loss_mask[rows]),
                jnp.asarray(lengths[rows]), jnp.asarray(anchors[rows]), jnp.asarray(keep[rows]))
        head = w.output_head[:, vocab]
        loss, aux = dflash_loss(weights, cfg, w.embed, head, *args, block_size=Q, gamma=4.0, t2d=jnp.asarray(t2d),
                                extra=more)
        sim = simulated_acceptance(weights, cfg, w.embed, head, *args, block_size=Q, t2d=jnp.asarray(t2d),
                                   extra=more)
        scored = scored_labels(jnp.asarray(labels[rows]), jnp.asarray(t2d), more and more[0], len(vocab))
        return float(loss), np.asarray(sim[0]), (np.asarray(scored) >= 0).sum(axis=(1, 2))

    batched = run(ids, slice(0, 2), (jnp.asarray(extra), w.vocab_rows))
    for i in range(2):
        union = np.sort(np.concatenate([ids, extra[i][extra[i] >= 0]]))
        one = run(ids, slice(i, i + 1), (jnp.asarray(extra[i:i + 1]), w.vocab_rows))
        wide, plain = run(union, slice(i, i + 1), None), run(ids, slice(i, i + 1), None)
        assert one[0] == pytest.approx(wide[0], rel=1e-5)
        np.testing.assert_array_equal(batched[1][i], wide[1][0])
        np.testing.assert_array_equal(one[1][0], wide[1][0])
        assert batched[2][i] == wide[2][0] > plain[2][0]  # the context ids' labels are scored, not the others


def test_labels_and_weights_match_a_python_loop(setup):
    *_, tokens, _, loss_mask, lengths = setup
    anchors, keep = sample_anchors(np.random.default_rng(9), loss_mask, lengths, 8, Q)
    keep[0, 2] = False
    anchors[1, 0] = lengths[1] - 2  # near the end: labels past the sequence get weight 0
    gamma = 7.0
    labels, w = labels_and_weights(jnp.asarray(tokens), jnp.asarray(loss_mask), jnp.asarray(lengths),
                                   jnp.asarray(anchors), jnp.asarray(keep), Q, gamma)
    labels, w = np.asarray(labels), np.asarray(w)
    for i in range(2):
        for j in range(anchors.shape[1]):
            for k in range(1, Q):
                p = anchors[i, j] + k
                expect_w = keep[i, j] * (p < lengths[i]) * (loss_mask[i, p] if p < lengths[i] else 0) * \
                    np.exp(-(k - 1) / gamma)
                assert w[i, j, k - 1] == pytest.approx(expect_w, abs=1e-7)
                if p < lengths[i]:
                    assert labels[i, j, k - 1] == tokens[i, p]


def test_dpace_weights_match_the_paper_formula():
    from specjax.train.objective import dpace_weights

    rng = np.random.default_rng(4)
    ce = rng.uniform(0.0, 4.0, (3, 5, 7)).astype(np.float32)
    inside = np.ones((3, 5, 7), bool)
    inside[1, 2, 4:] = False  # the response ends inside this block
    scored = inside.copy()
    scored[2, 0, 1] = False  # label outside the draft vocabulary: never accepted
    alpha = 0.5
    w = np.asarray(dpace_weights(jnp.asarray(ce), jnp.asarray(inside), jnp.asarray(scored), alpha))
    for idx in np.ndindex(3, 5):
        q = np.where(scored[idx], (1 - alpha) * np.exp(-ce[idx]) + alpha, alpha)
        prefix = [np.prod(q[:m + 1]) if inside[idx][m] else 0.0 for m in range(7)]
        expect = [sum(prefix[j:]) if scored[idx][j] else 0.0 for j in range(7)]
        np.testing.assert_allclose(w[idx], expect, rtol=1e-5, atol=1e-7)
    assert (np.diff(w[0], axis=-1) <= 1e-6).all()  # earlier slots always weigh at least as much
    # alpha = 1 ignores confidence: slot j weighs the number of slots from j to the end of the response
    w1 = np.asarray(dpace_weights(jnp.asarray(ce), jnp.asarray(inside), jnp.asarray(inside), 1.0))
    np.testing.assert_allclose(w1[1, 2], [4, 3, 2, 1, 0, 0, 0])
    # the weights carry no gradient: D-PACE reweights the cross-entropy, it does not optimize the confidence
    g = jax.grad(lambda c: dpace_weights(c, jnp.asarray(inside), jnp.asarray(scored), alpha).sum())(jnp.asarray(ce))
    assert not np.asarray(g).any()


def test_a_few_steps_reduce_the_loss(setup):
    target, cfg, weights, tokens, taps, loss_mask, lengths = setup
    anchors, keep = sample_anchors(np.random.default_rng(2), loss_mask, lengths, 8, Q)
    w = target.weights
    args = (w.embed, w.output_head, jnp.asarray(tokens), jnp.asarray(taps), jnp.asarray(loss_mask),
            jnp.asarray(lengths), jnp.asarray(anchors), jnp.asarray(keep))
    losses = adam_losses(lambda p: dflash_loss(p, cfg, *args, block_size=Q, gamma=4.0), weights, 30)
    assert losses[-1] < 0.5 * losses[0], losses
    losses = adam_losses(lambda p: dflash_loss(p, cfg, *args, block_size=Q, gamma=4.0, dpace_alpha=0.5), weights, 30)
    assert losses[-1] < 0.5 * losses[0], losses


def test_fc_init_equalises_massive_input_dimensions():
    from specjax.train.drafter_init import scale_fc_init

    fc = jax.random.normal(jax.random.PRNGKey(0), (6, 4)) * 0.02
    rms = jnp.asarray([1.0, 1.0, 3000.0, 2.0, 1.0, 0.5])
    out = np.asarray(scale_fc_init(fc, rms))
    ratio = np.abs(out / np.asarray(fc))
    np.testing.assert_allclose(ratio[2] * 3000, ratio[0], rtol=1e-5)  # the massive row is scaled down 3000x
    assert np.sqrt(np.mean(out ** 2)) == pytest.approx(float(np.sqrt(np.mean(np.asarray(fc) ** 2))), rel=1e-5)


def test_init_from_target_layer_reproduces_its_context_keys_and_values(setup):
    """A drafter started from target layers (2, 3) reading tap 2 (= the input of layer 2): its first layer's
    context K/V rows equal the target's own layer-2 K/V rows (the tiny Qwen3 has q/k norms, copied too)."""
    from specjax.model import target as tgt
    from specjax.train.drafter_init import init_from_target
    from specjax.train.methods import DFlashMethod

    target, _, _, tokens, *_ = setup
    cfg = drafter_config_for(target.config, num_layers=2, block_size=Q, target_layer_ids=(0, 1),
                             mask_embedding=True)  # taps = hidden states 1, 2
    weights = init_from_target(init_drafter(cfg, jax.random.PRNGKey(0)), cfg, target, (2, 3))
    seq = jnp.asarray(tokens[:1, :16])
    positions = jnp.arange(16)[None]
    batch = tgt.ForwardBatch(seq, positions, jnp.zeros((1, 16), jnp.int32), jnp.zeros((1, 1), jnp.int32))
    kv = tgt.init_kv_pages(target.config.num_layers, 1, 1, target.config.num_kv_heads, target.config.head_dim)
    _, taps, rows = tgt.forward(target.weights, kv, batch, target.config, cfg.hidden_state_indices)
    ours = dflash.observe(weights, cfg, taps, positions)
    np.testing.assert_allclose(np.asarray(ours.k[0]), np.asarray(rows.k[2]), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(ours.v[0]), np.asarray(rows.v[2]), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not tap hidden state 3"):
        init_from_target(init_drafter(cfg, jax.random.PRNGKey(0)), cfg, target, (3, 3))
    assert DFlashMethod(cfg, Q, 4, 4.0, init_layers=(2, 3)).init_params(jax.random.PRNGKey(0), target).fc.shape \
        == weights.fc.shape


def test_block_start_tau_walks_the_positions_a_greedy_engine_drafts_from():
    from specjax.train.simtau import block_start_tau

    accepted = np.array([2, 0, 0, 1, 0])  # drafts accepted when drafting from each answer position
    # K = 3: draft at 0 (2 accepted + bonus -> next start 3), at 3 (1 + bonus -> 5 = end): steps of 3 and 2 tokens
    assert block_start_tau([accepted], 3) == 2.5
    # K = 1 caps each run: starts 0 (1), 2 (0), 3 (1) -> 2, 1, 2 tokens
    assert block_start_tau([accepted], 1) == 5 / 3
    # every-anchor mean would be 1 + mean(min(acc, 3)) = 1.6: block starts are not average positions
    assert block_start_tau([accepted, np.array([0, 0])], 3) == (3 + 2 + 1 + 1) / 4
    # prompt lookup replacing the drafter where it proposes (>= 0): 0 accepted at 0 and 1 at 1, then the drafter's 1
    # at 3: steps of 1, 2, 2 tokens
    assert block_start_tau([accepted], 3, [np.array([0, 1, -1, -1, -1])]) == 5 / 3


def test_lookup_accepted_counts_what_verification_of_lookups_drafts_would_keep():
    from specjax.train.simtau import lookup_accepted

    #         prompt | answer: anchors at positions 3..8 (the bonus token; its context is everything up to it)
    tokens = [1, 2, 3, 9, 1, 2, 3, 9, 5, 6]
    # anchor 3 (context 1 2 3 9): no earlier 9 -> -1; anchor 4 (...9 1): "1" seen at 0, proposes 2 3 9 = truth 2 3 9
    # -> 3; anchor 5 ("1 2" at 0-1): 3 9 1 vs truth 3 9 5 -> 2; anchor 6: 9 1 2 vs 9 5 6 -> 1; anchor 7 ("9" at 3):
    # 1 2 3 vs 5 6 -> 0; anchor 8: no earlier 5 -> -1
    assert list(lookup_accepted(tokens, 3, 6, 3, 1)) == [-1, 3, 2, 1, 0, -1]
    assert list(lookup_accepted(tokens, 3, 6, 3, 2)) == [-1, -1, 2, 1, 0, -1]  # "9 1" / "1 2 3" / "2 3 9" repeat


def test_grown_drafter_drafts_as_the_old_one_and_its_new_layer_trains(setup, tmp_path):
    """--grow-layers: a saved 2-layer drafter loaded as 3 layers gives the same block logits (the new layer
    starts as an identity), saves and reloads as 3 layers, and the loss moves the new layer's output projection."""
    from specjax.drafter.loader import load_drafter, save_drafter
    from specjax.train.methods import DFlashMethod

    target, cfg, weights, tokens, taps, loss_mask, lengths = setup
    save_drafter(str(tmp_path / "two"), cfg, weights)
    grown_cfg = dataclasses.replace(cfg, num_layers=3)
    method = DFlashMethod(grown_cfg, Q, 6, 4.0)
    grown = method.load(str(tmp_path / "two"), target.config)
    assert len(grown.layers) == 3 and not np.asarray(grown.layers[2].w_o).any()
    w = target.weights
    anchors, keep = sample_anchors(np.random.default_rng(5), loss_mask, lengths, 6, Q)
    args = (w.embed, w.output_head, jnp.asarray(tokens), jnp.asarray(taps))
    before = block_logits(weights, cfg, *args, jnp.asarray(anchors), jnp.asarray(keep), Q)
    after = block_logits(grown, grown_cfg, *args, jnp.asarray(anchors), jnp.asarray(keep), Q)
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), atol=1e-5, rtol=1e-5)
    grad = jax.grad(lambda p: dflash_loss(p, grown_cfg, *args, jnp.asarray(loss_mask), jnp.asarray(lengths),
                                          jnp.asarray(anchors), jnp.asarray(keep), block_size=Q, gamma=4.0)[0])(grown)
    assert np.abs(np.asarray(grad.layers[2].w_o)).max() > 0
    method.save(str(tmp_path / "three"), grown)
    assert load_drafter(str(tmp_path / "three"), target.config)[0].num_layers == 3
    with pytest.raises(ValueError, match="cannot grow a 2-layer drafter to 1"):
        DFlashMethod(dataclasses.replace(cfg, num_layers=1), Q, 6, 4.0).load(str(tmp_path / "two"), target.config)


def test_grown_lr_scale_multiplies_only_the_appended_layers_updates(setup, tmp_path):
    """--grown-lr-scale: one optimizer step of a grown drafter moves the appended layer's weights by exactly the
    scale times what the same step moves them without it, and every other leaf by the same amount as without it."""
    from specjax.drafter.loader import save_drafter
    from specjax.train.config import TrainConfig
    from specjax.train.methods import DFlashMethod
    from specjax.train.optimizer import make_optimizer

    target, cfg, weights, tokens, taps, loss_mask, lengths = setup
    save_drafter(str(tmp_path / "two"), cfg, weights)
    grown_cfg = dataclasses.replace(cfg, num_layers=3)
    grown = DFlashMethod(grown_cfg, Q, 6, 4.0).load(str(tmp_path / "two"), target.config)
    w = target.weights
    anchors, keep = sample_anchors(np.random.default_rng(5), loss_mask, lengths, 6, Q)
    grads = jax.grad(lambda p: dflash_loss(p, grown_cfg, w.embed, w.output_head, jnp.asarray(tokens),
                                           jnp.asarray(taps), jnp.asarray(loss_mask), jnp.asarray(lengths),
                                           jnp.asarray(anchors), jnp.asarray(keep), block_size=Q, gamma=4.0)[0])(grown)

    def second_update(scale):  # the first is at lr 0 (the warm-up starts there)
        tcfg = TrainConfig(optimizer="muon", lr=1e-3, warmup_ratio=0.0, steps=10, grown_layers=1,
                           grown_lr_scale=scale)
        opt = make_optimizer(tcfg)[0]
        state = opt.update(grads, opt.init(grown), grown)[1]
        return opt.update(grads, state, grown)[0]

    plain, scaled = (jax.tree_util.tree_leaves_with_path(second_update(s)) for s in (1.0, 5.0))
    assert [p for p, _ in plain] == [p for p, _ in scaled]
    for (path, a), (_, b) in zip(plain, scaled):
        appended = getattr(path[0], "name", None) == "layers" and path[1].idx == 2
        np.testing.assert_allclose(np.asarray(b), np.asarray(a) * (5.0 if appended else 1.0), rtol=1e-6, atol=1e-12)
    moved = {str(path[-1]) for path, a in plain if path[1:2] and getattr(path[1], "idx", None) == 2 and
             np.abs(np.asarray(a)).max() > 0}
    assert {".w_o", ".w_down"} <= moved  # the zero output projections get gradient (the rest waits for them)


def test_distillation_teacher_is_the_targets_own_next_token_distribution(setup):
    """--distill: the teacher logits of slot k at anchor a are the target's own logits for x[a + k] (a full target
    forward, draft-vocabulary columns); with distill = 1 the loss is the weighted KL computed by hand, it is 0
    when the teacher is the drafter itself, and distill = 0 gives the plain loss; through DFlashMethod the
    teacher tap rides after the drafter's taps and a few steps reduce the mixed loss."""
    from specjax.train.methods import DFlashMethod
    from specjax.train.objective import teacher_logits

    target, cfg, weights, tokens, taps, loss_mask, lengths = setup
    w, n = target.weights, target.config.num_layers
    final = np.zeros((*tokens.shape, target.config.hidden_size), np.float32)
    full_logits = []
    for i, length in enumerate(lengths):
        lg, h = full_forward(w, target.config, list(tokens[i, :length]), (n,))
        final[i, :length], _ = np.asarray(h), full_logits.append(lg)
    ids = np.sort(np.random.default_rng(3).choice(target.config.vocab_size, 120, replace=False))
    head = w.output_head[:, ids]
    anchors, keep = sample_anchors(np.random.default_rng(8), loss_mask, lengths, 5, Q)
    teacher = np.asarray(teacher_logits(jnp.asarray(final), w.final_norm, target.config.rms_norm_eps, head,
                                        jnp.asarray(anchors), Q))
    for i in range(2):
        for j in range(anchors.shape[1]):
            for k in range(1, Q):
                np.testing.assert_allclose(teacher[i, j, k - 1], full_logits[i][anchors[i, j] + k - 1][ids],
                                           atol=2e-4, rtol=2e-4)
    args = (w.embed, w.output_head, jnp.asarray(tokens), jnp.asarray(taps), jnp.asarray(loss_mask),
            jnp.asarray(lengths), jnp.asarray(anchors), jnp.asarray(keep))
    full_teacher = teacher_logits(jnp.asarray(final), w.final_norm, target.config.rms_norm_eps, w.output_head,
                                  jnp.asarray(anchors), Q)
    plain, _ = dflash_loss(weights, cfg, *args, block_size=Q, gamma=4.0)
    assert float(dflash_loss(weights, cfg, *args, block_size=Q, gamma=4.0, teacher=full_teacher, distill=0.0)[0]) \
        == float(plain)
    logits = np.asarray(block_logits(weights, cfg, w.embed, w.output_head, args[2], args[3], args[6], args[7], Q))
    _, wts = labels_and_weights(*(args[i] for i in (2, 4, 5, 6, 7)), Q, 4.0)
    ft = np.asarray(full_teacher, np.float64)
    log_p = ft - ft.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = logits - logits.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    expect = (np.asarray(wts) * kl).sum() / (np.asarray(wts).sum() + 1e-6)
    loss, _ = dflash_loss(weights, cfg, *args, block_size=Q, gamma=4.0, teacher=full_teacher, distill=1.0)
    assert float(loss) == pytest.approx(expect, rel=1e-4) and expect > 0.1
    own, _ = dflash_loss(weights, cfg, *args, block_size=Q, gamma=4.0, teacher=jnp.asarray(logits), distill=1.0)
    assert abs(float(own)) < 1e-4
    method = DFlashMethod(cfg, Q, 5, 4.0, draft_ids=tuple(int(i) for i in ids), distill=0.5, teacher_tap=n,
                          teacher_eps=target.config.rms_norm_eps)
    assert method.tap_indices == cfg.hidden_state_indices + (n,)
    with pytest.raises(ValueError, match="teacher_tap"):
        DFlashMethod(cfg, Q, 5, 4.0, distill=0.5)
    consts = method.constants(target)
    both = jnp.concatenate([jnp.asarray(taps), jnp.asarray(final)], axis=-1)
    extra = (jnp.asarray(anchors), jnp.asarray(keep))
    losses = adam_losses(lambda p: method.loss(p, consts, args[2], both, args[4], args[5], extra), weights, 30)
    assert losses[-1] < 0.5 * losses[0], losses
