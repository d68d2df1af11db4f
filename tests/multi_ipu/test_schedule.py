"""The host schedule: Graphcore's pipeline (ramp-up, steady state alternating forward and
backward on every IPU, ramp-down) and sharded execution, one micro-batch at a time."""

import pytest

from ipu_backend.runtime.schedule import inference_order, stashed_micro_batches, training_order


def positions(order):
    return {event: index for index, event in enumerate(order)}


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("micro_batches,stages", [(3, 2), (7, 4), (12, 3)])
def test_every_pass_runs_once_after_what_it_needs(micro_batches, stages, pipelined):
    order = training_order(micro_batches, stages, pipelined)
    at = positions(order)
    last = stages - 1
    expected = {("F", k, m) for k in range(last) for m in range(micro_batches)} | \
        {("FB", last, m) for m in range(micro_batches)} | {("B", k, m) for k in range(last) for m in range(micro_batches)}
    assert len(order) == len(at) and set(order) == expected
    for m in range(micro_batches):
        forwards = [at["F", k, m] for k in range(last)] + [at["FB", last, m]]
        backwards = [at["FB", last, m]] + [at["B", k, m] for k in reversed(range(last))]
        assert forwards == sorted(forwards) and backwards == sorted(backwards)
    for k in range(last):     # each stage keeps micro-batch order, forward and backward
        assert [at["F", k, m] for m in range(micro_batches)] == sorted(at["F", k, m] for m in range(micro_batches))
        assert [at["B", k, m] for m in range(micro_batches)] == sorted(at["B", k, m] for m in range(micro_batches))


def test_pipeline_ramps_up_alternates_then_ramps_down():
    micro_batches, stages = 12, 3
    order = training_order(micro_batches, stages, pipelined=True)
    stage0 = [role for role, k, _ in order if k == 0]
    # IPU 0 runs forwards alone for 2(S-1) cycles, then alternates F and B, then drains backwards.
    ramp = 2 * (stages - 1)
    assert stage0[:ramp] == ["F"] * ramp
    assert stage0[ramp:2 * micro_batches - ramp] == ["F", "B"] * (micro_batches - ramp)
    assert stage0[2 * micro_batches - ramp:] == ["B"] * ramp
    assert order[0] == ("F", 0, 0) and order[-1] == ("B", 0, micro_batches - 1)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stash_depth_matches_the_memory_model(stages):
    order = training_order(4 * stages, stages, pipelined=True)
    for k in range(stages - 1):
        live = deepest = 0
        for role, stage, _ in order:
            if stage == k:
                live += 1 if role == "F" else -1
                deepest = max(deepest, live)
        assert deepest == stashed_micro_batches(k, stages, pipelined=True)


def test_sharded_runs_one_micro_batch_at_a_time():
    order = training_order(3, 3, pipelined=False)
    assert order[:5] == [("F", 0, 0), ("F", 1, 0), ("FB", 2, 0), ("B", 1, 0), ("B", 0, 0)]
    assert [m for _, _, m in order] == sorted(m for _, _, m in order)
    assert inference_order(2, 3, pipelined=False) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert inference_order(3, 2, pipelined=True) == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2)]
