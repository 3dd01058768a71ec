"""The Eagle3 resource manager's slot lifecycle, on its own and through ModelRunner plans."""

import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts

from speculative.config import SamplingParams
from speculative.plan import PrefillRow, StepPlan
from speculative.resource_manager import Eagle3ResourceManager, SlotError


@pytest.fixture
def manager():
    return Eagle3ResourceManager(
        num_slots=4,
        max_step_tokens=32,
        feature_dim=12,
        hidden_size=4,
        dtype=torch.float32,
        device="cpu",
    )


def test_allocate_free_reallocate(manager):
    for slot in range(4):
        manager.allocate(slot)
    manager.check_allocated([0, 1, 2, 3])
    manager.free(2)
    manager.check_allocated([0, 1, 3])
    manager.allocate(2)  # a freed slot can be taken again
    assert manager.is_allocated == [True] * 4


def test_double_allocate_and_double_free(manager):
    manager.allocate(1)
    with pytest.raises(SlotError, match="already allocated"):
        manager.allocate(1)
    manager.free(1)
    with pytest.raises(SlotError, match="double free of slot 1"):
        manager.free(1)
    with pytest.raises(SlotError, match="double free of slot 3"):
        manager.free(3)  # never taken


def test_reading_a_freed_slot_is_refused(manager):
    manager.allocate(0)
    manager.allocate(1)
    manager.free(1)
    with pytest.raises(SlotError, match="slot 1 is read but not allocated"):
        manager.check_allocated([0, 1])


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_slot_out_of_range(manager, slot):
    with pytest.raises(SlotError, match="outside 0..3"):
        manager.allocate(slot)


def test_buffers(manager):
    assert manager.feature_view(4, 8).shape == (4, 8, 12)
    with pytest.raises(SlotError, match="exceeds the feature buffer"):
        manager.feature_view(4, 9)
    hidden = torch.arange(8.0).view(2, 4)
    manager.write_hidden(torch.tensor([3, 0]), hidden)
    assert torch.equal(manager.read_hidden(torch.tensor([0, 3])), hidden.flip(0))
    # features + per-slot hidden (with the dummy slot)
    assert manager.nbytes == (32 * 12 + 5 * 4) * 4


# ---- through the model runner ----


@pytest.fixture
def runner(tiny_dir, tiny_drafter_dir):
    return tiny_engine(tiny_dir, tiny_drafter_dir, k=2, max_batch_size=2).executor


def prefill(slot, step_id, free=()):
    return StepPlan(
        step_id,
        prefills=[PrefillRow(slot, [1, 2, 3, 4], 0, SamplingParams())],
        free_slots=list(free),
        kv_len=64,
    )


def test_runner_refuses_a_plan_reading_a_freed_slot(runner):
    runner.execute(prefill(0, 0)).result()
    runner.execute(StepPlan(1, decode_slots=[0], kv_len=64)).result()  # slot 0 live: fine
    with pytest.raises(SlotError, match="slot 0 is read but not allocated"):
        runner.execute(StepPlan(2, decode_slots=[0], free_slots=[0], kv_len=64))
    with pytest.raises(SlotError, match="slot 1 is read but not allocated"):
        runner.execute(StepPlan(3, decode_slots=[1], kv_len=64))  # never taken


def test_runner_refuses_a_double_free(runner):
    runner.execute(prefill(1, 0)).result()
    runner.execute(prefill(0, 1, free=[1])).result()
    with pytest.raises(SlotError, match="double free of slot 1"):
        runner.execute(StepPlan(2, decode_slots=[0], free_slots=[1], kv_len=64))


def test_runner_refuses_to_prefill_a_live_slot(runner):
    runner.execute(prefill(0, 0)).result()
    with pytest.raises(SlotError, match="already allocated"):
        runner.execute(prefill(0, 1))


def test_engine_lifecycle_reuses_and_releases_every_slot(tiny_dir, tiny_drafter_dir):
    """More requests than slots, ending at different times: slots are reused, and at the end every
    slot is free on the host and the ones still live on the worker are exactly those whose release
    rides on the next plan."""
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, max_batch_size=3)
    seen = []
    original = engine.executor.execute

    def record(plan):
        seen.append([p.slot for p in plan.prefills])
        return original(plan)

    engine.executor.execute = record
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12, 1, 7, 4)]
    requests = run_to_completion(engine, tiny_prompts(7, seed=8), params)
    assert [len(r.output_ids) for r in requests] == [3, 9, 5, 12, 1, 7, 4]
    taken = [s for slots in seen for s in slots]
    assert len(taken) == 7 and set(taken) == {0, 1, 2}
    scheduler, resources = engine.scheduler, engine.executor.resources
    assert sorted(scheduler.free_slots) == [0, 1, 2] and not scheduler.running
    assert {s for s in range(3) if resources.is_allocated[s]} == set(scheduler.slots_to_release)
