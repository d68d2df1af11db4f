"""The modelled schedule: slots per pass, the pipeline's bubble and the IPUs' utilization."""

import pytest

from ipu_backend.profiling.timeline import BACKWARD, FORWARD, UPDATE, bubble_fraction, timeline, utilization


def one_stage_per_ipu(stages: int) -> list[set[int]]:
    return [{k} for k in range(stages)]


@pytest.mark.parametrize("stages, micro_batches", [(1, 1), (2, 3), (2, 8), (3, 5), (4, 7), (4, 16)])
def test_pipelined_training_bubble_is_the_ramp_up_and_down_of_2s_minus_2_cycles(stages, micro_batches):
    line = timeline(True, micro_batches, stages, pipelined=True)
    cycles = micro_batches + 2 * stages - 2
    assert line.pass_length == 2 * cycles
    assert line.length == 2 * cycles + 1                     # and one optimizer update
    expected = (2 * stages - 2) / (micro_batches + 2 * stages - 2)
    assert bubble_fraction(line, one_stage_per_ipu(stages)) == pytest.approx(expected)
    for stage in range(stages):
        assert utilization(line, {stage}) == pytest.approx((2 * micro_batches + 1) / (2 * cycles + 1))


@pytest.mark.parametrize("stages, micro_batches", [(2, 2), (3, 4), (4, 9)])
def test_pipelined_inference_bubble_is_s_minus_1_cycles(stages, micro_batches):
    line = timeline(False, micro_batches, stages, pipelined=True)
    assert line.length == micro_batches + stages - 1
    assert bubble_fraction(line, one_stage_per_ipu(stages)) == pytest.approx(
        (stages - 1) / (micro_batches + stages - 1))
    assert not any(slot.role != FORWARD for slot in line.slots)


@pytest.mark.parametrize("training", [True, False])
def test_sharded_execution_keeps_one_ipu_busy_at_a_time(training):
    stages, micro_batches = 3, 4
    line = timeline(training, micro_batches, stages, pipelined=False)
    passes = [slot for slot in line.slots if slot.role != UPDATE]
    assert sorted(slot.start for slot in passes) == list(range(len(passes)))   # never two at once
    assert bubble_fraction(line, one_stage_per_ipu(stages)) == pytest.approx(1 - 1 / stages)


def test_every_micro_batch_runs_forward_then_backward_on_each_stage_in_dependency_order():
    stages, micro_batches = 3, 6
    line = timeline(True, micro_batches, stages, pipelined=True)
    at = {(slot.role, slot.stage, slot.micro_batch): slot for slot in line.slots}
    assert len([s for s in line.slots if s.role in (FORWARD, BACKWARD)]) == stages * micro_batches * 2
    for m in range(micro_batches):
        for k in range(stages - 1):
            assert at[FORWARD, k, m].end <= at[FORWARD, k + 1, m].start
            assert at[BACKWARD, k + 1, m].end <= at[BACKWARD, k, m].start
        assert at[FORWARD, stages - 1, m].end <= at[BACKWARD, stages - 1, m].start
    for k in range(stages):                                  # an IPU runs one pass at a time
        starts = [slot.start for slot in line.slots if slot.stage == k]
        assert len(starts) == len(set(starts))


def test_two_stages_on_one_ipu_count_once_in_its_utilization():
    line = timeline(True, 4, 3, pipelined=False)      # per micro-batch: F0 F1 F2 B2 B1 B0
    assert line.length == 4 * 6 + 1
    # stages 0 and 2 on IPU 0 (4 of the 6 slots of each micro-batch), stage 1 on IPU 1 (2 of 6)
    assert utilization(line, {0, 2}) == pytest.approx(17 / 25)
    assert utilization(line, {1}) == pytest.approx(9 / 25)
    assert bubble_fraction(line, [{0, 2}, {1}]) == pytest.approx(1 - (16 + 8) / (2 * 24))
