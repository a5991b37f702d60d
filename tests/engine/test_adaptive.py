"""Adaptive speculation: the controller's choice, and losslessness when K changes from step to step."""

import jax
import numpy as np

from specjax.config import EngineConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.engine.controller import AdaptiveK
from specjax.engine.engine import LLMEngine
from specjax.model.loader import load_model
from specjax.sampling import GREEDY, SamplingParams
from specjax.spec.proposer import DFlashProposer
from tests.helpers import random_prompt

PAGES = {0: 4, 1: 4, 3: 4, 7: 4}


def test_controller_turns_speculation_off_when_it_does_not_pay():
    c = AdaptiveK((0, 3, 7), 7, min_explore_every=10**6)
    for k, t in [(0, 1.0), (3, 1.6), (7, 2.2)]:
        c.record_cost(1, k, 4, t)
    for _ in range(200):
        c.record_acceptance(7, 0)  # drafts never accepted
    assert c.choose(1, 1, PAGES) == 0
    for _ in range(2000):
        c.record_acceptance(7, 7)  # everything accepted: tau(7) = 8 for 2.2x the cost
    assert c.choose(1, 1, PAGES) == 7
    c.record_cost(8, 0, 4, 1.0)
    c.record_cost(8, 3, 4, 5.0)
    c.record_cost(8, 7, 4, 9.0)  # at a big batch verification is expensive: 8 / 9 < 1 / 1
    assert c.choose(8, 8, PAGES) == 0


def test_controller_cost_is_a_robust_median_per_page_bucket():
    c = AdaptiveK((0, 3), 3, min_explore_every=10**6)
    for t in (1.0, 1.0, 1.1, 0.9):
        c.record_cost(1, 0, 4, t)
    c.record_cost(1, 0, 4, 50.0)  # one step stalled by the host
    assert c.cost(1, 0, 4) == 1.0
    c.record_cost(1, 0, 64, 3.0)
    assert c.cost(1, 0, 64) == 3.0 and c.cost(1, 0, 16) == 1.0 and c.cost(1, 0, 128) == 3.0  # nearest bucket
    assert c.cost(2, 0, 4) is None
    c.record_cost(1, 3, 4, 1.5)
    c.record_cost(1, 3, 64, 9.0)
    for _ in range(500):
        c.record_acceptance(3, 3)  # tau(3) -> 4
    assert c.choose(1, 1, {0: 4, 3: 4}) == 3  # 4 / 1.5 > 1 / 1.0
    assert c.choose(1, 1, {0: 4, 3: 64}) == 0  # the drafts would cross into a page bucket 6x dearer


def test_controller_explores_smallest_k_within_its_time_budget():
    c = AdaptiveK((0, 3, 7), 7, explore_budget=0.05, idle_budget=0.005, min_explore_every=4, refresh_every=10**6)
    for k, t in [(0, 1.0), (3, 2.2), (7, 100.0)]:
        c.record_cost(1, k, 4, t)
    for _ in range(10):
        c.record_acceptance(3, 1)  # tau(3) ~ 1.98 for 2.2x the cost: K = 0 wins, but 10 samples cannot rule K = 3 out
    assert c.expected_tau(3) < 2.2 < c.expected_tau(3, optimistic=True)
    picks = [c.choose(1, 1, PAGES) for _ in range(400)]
    assert set(picks) == {0, 3}  # never the dear K = 7
    explore_time = picks.count(3) * (2.2 - 1.0)
    assert picks.count(3) == 16 and explore_time / len(picks) <= 0.05  # period (2.2 - 1) / (0.05 * 1) = 24
    c.record_acceptance(7, 3)
    p = c.per_position()
    assert all(a >= b for a, b in zip(p, p[1:]))


def test_controller_explores_rarely_once_no_k_can_plausibly_win():
    c = AdaptiveK((0, 3, 7), 7, explore_budget=0.05, idle_budget=0.005, min_explore_every=4, refresh_every=10**6)
    for k, t in [(0, 1.0), (3, 2.0), (7, 3.0)]:
        c.record_cost(1, k, 4, t)
    assert c.expected_tau(3, optimistic=True) > 3.0  # the prior alone: anything is plausible
    for _ in range(200):
        c.record_acceptance(3, 0)  # drafts never accepted: even the upper bound on tau(3) is far below 2
    assert c.expected_tau(3, optimistic=True) < 1.2 and c.expected_tau(7, optimistic=True) < 1.5
    picks = [c.choose(1, 1, PAGES) for _ in range(1000)]
    assert picks.count(3) == 5 and 7 not in picks  # period (2 - 1) / (0.005 * 1) = 200
    for _ in range(100):
        c.record_acceptance(3, 3)  # the workload changed: the next exploration sees it and speculation resumes
    assert c.choose(1, 1, PAGES) == 3


def test_controller_climbs_to_a_larger_k_when_drafts_are_good():
    """A step at K only measures p_1..p_K: with flat verification costs (a GPU) and a drafter that is always
    right, exploration must carry the choice from the cheapest K up to the largest."""
    c = AdaptiveK((0, 3, 7, 15), 15, explore_budget=0.05, min_explore_every=4, refresh_every=10**6)
    for k, t in [(0, 1.0), (3, 1.1), (7, 1.2), (15, 1.4)]:
        c.record_cost(1, k, 4, t)
    picks = []
    for _ in range(300):
        k = c.choose(1, 1, {0: 4, 3: 4, 7: 4, 15: 4})
        picks.append(k)
        c.record_acceptance(k, k)  # every draft accepted
    assert picks[-50:].count(15) == 50, picks[-50:]
    assert c.expected_tau(15) > 15


def test_controller_per_position_keeps_positions_beyond_the_explored_k():
    c = AdaptiveK((0, 3, 7), 7)
    for _ in range(100_000):  # long enough that decaying every position would underflow to 0 / 0
        c.record_acceptance(3, 1)
    p = c.per_position()
    assert np.all(np.isfinite(p)) and abs(p[0] - 1.0) < 1e-6 and p[1] < 1e-6 and p[3] <= p[2]


def test_adaptive_engine_is_lossless_and_uses_several_k(tiny_dirs):
    """K changes from step to step (every option of the controller, drafts accepted at K >= 3) and the tokens equal
    plain decoding's.  The drafts that get accepted are prompt lookup's (lookup_min_match = 1 over repetitive
    prompts, a random drafter's otherwise), and the injected costs are nearly flat in the rows verified, as on an
    accelerator, so that the controller climbs past K = 0 (with a random drafter alone it stayed near K = 0)."""
    target = load_model(tiny_dirs["qwen3"])
    dcfg = drafter_config_for(target.config, num_layers=1, block_size=8, target_layer_ids=(0, 2), mask_token_id=299)
    dw = init_drafter(dcfg, jax.random.PRNGKey(0))
    prompts = [random_prompt(np.random.default_rng(i), 2 + i) * 4 for i in range(4)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    base = LLMEngine(target.config, target.weights, config=EngineConfig(max_model_len=64, page_size=4))
    expected = [s.output_ids for s in base.generate(prompts, params)]
    engine = LLMEngine(target.config, target.weights, DFlashProposer(dcfg, 8), dw,
                       EngineConfig(max_model_len=64, page_size=8, max_num_seqs=4, adaptive_k=True,
                                    page_bucket_factor=4, lookup_min_match=1))
    # Step costs are injected, not timed: measured ones made the choice depend on the machine's load (under the
    # 2-worker suite a K = 0 step timed while the other worker compiled kept K = 7 chosen for the whole run).
    record = engine._record_cost
    engine._record_cost = lambda need, shape, seconds: record(need, shape, 1.0 + 0.01 * need.n)
    # every K at the batch of 4 and the page widths these requests reach (smaller batches run padded in them)
    engine.warmup([len(p) for p in prompts], max(len(p) for p in prompts) + 30, batch_sizes=(4,), modes=(GREEDY,))
    c = engine.controller
    c.explore_budget, c.idle_budget, c.min_explore_every = 100.0, 100.0, 3
    seqs = engine.generate(prompts, params)
    assert [s.output_ids for s in seqs] == expected
    # measured: K = 3 / 1 / 7 / 0 in 11 / 6 / 5 / 3 steps, accepted lengths up to 5
    assert len(engine.k_history) >= 3, engine.k_history
    assert max(t for s in seqs for t in s.stats.acceptance_lengths) >= 4
    assert engine.allocator.num_used == 0


def test_controller_retimes_a_cheaper_k_whose_cost_was_inflated_once():
    """Start-up timed K = 0 while another process compiled (3x its real cost): speculation looks worth it.  The
    controller must re-time K = 0 within `refresh_every` steps, drop the stale timings and stop speculating."""
    c = AdaptiveK((0, 3), 3, min_explore_every=10**6, refresh_every=50)
    for k, t in [(0, 3.0), (0, 3.0), (3, 2.0), (3, 2.0)]:
        c.record_cost(1, k, 4, t)  # warm-up: K = 0 inflated
    for _ in range(100):
        c.record_acceptance(3, 0)  # tau(3) ~ 1: the drafts are useless, K = 3 only "wins" through K = 0's cost
    picks = []
    for _ in range(200):
        k = c.choose(1, 1, {0: 4, 3: 4})
        picks.append(k)
        c.record_cost(1, k, 4, {0: 1.0, 3: 2.0}[k])  # the real costs
    assert picks[0] == 3 and picks.index(0) == 50  # the 51st choice re-times K = 0
    assert c.cost(1, 0, 4) == 1.0 and set(picks[51:]) == {0}  # the stale 3.0 s expired at once
