"""Late constrained rows on a rank (speculative.plan.LateGrammar): a step whose plan holds
constrained rows while their last step is still in flight launches its target pass, then waits
for their masks, which the coordinator sends once it has processed that step. The Ray worker
reads them from its plan socket; in one process the step waits as a DeferredStep."""

import torch

from speculative.plan import LateGrammar, StepPlan
from workers.step_io import StepOutput
from workers.sync_guard import allow_host_sync


class DeferredStep:
    """A step under way (ModelRunner.execute): its generator, and once it has run to its end
    the StepOutput; in one process a step with late constrained rows waits here, its target
    pass launched, until their masks are sent (ModelRunner.send_late_grammar)."""

    def __init__(self, plan: StepPlan, inputs: dict, run, received_at: float, started: float):
        self.plan, self.inputs, self.run = plan, inputs, run
        self.received_at, self.started = received_at, started
        self.start_event = None
        self.output: StepOutput | None = None

    def result(self):
        return self.output.result()


def write_late_grammar(runner, plan: StepPlan, late: LateGrammar) -> None:
    """After the target pass: the late rows' masks into the slot state, and their tokens to the
    rank's draft grammars."""
    assert late.step_id == plan.step_id, (late.step_id, plan.step_id)
    slots = torch.tensor([plan.slots[i] for i in late.rows])
    with allow_host_sync():  # copies from pageable host memory
        masks = torch.from_numpy(late.masks).to(runner.device)
        runner.state.grammar_mask.index_copy_(0, slots.to(runner.device), masks)
    if runner.draft_grammars is not None:
        runner.draft_grammars.follow(late.draft_grammars)
