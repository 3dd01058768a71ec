"""The constrained rows of a step on the host (structured outputs): the bitmasks of each row's
verify nodes after its output and drafts (speculative/grammar.py), sent in the plan or, for a
row whose last step is still in flight, late (LateGrammar) once that step is processed; and each
step's emitted tokens and new drafts followed by the row's grammar."""

import torch

from speculative.engine.request import Request
from speculative.plan import LateGrammar, StepPlan, StepResult


def add_grammar_masks(plan: StepPlan, rows: list[Request], num_nodes: int) -> None:
    """The mask rows of the plan's constrained rows ready now; the others marked late."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    plan.late_grammar_rows = [i for i in constrained if rows[i].in_flight > 1]
    ready = [i for i in constrained if rows[i].in_flight == 1]
    if ready:
        plan.grammar_rows = ready
        plan.grammar_masks, plan.draft_grammars = grammar_masks(plan, rows, ready, num_nodes)


def late_grammar(plan: StepPlan, rows: list[Request], num_nodes: int) -> LateGrammar | None:
    """Once the step before `plan` is processed: the masks of plan's late rows (`rows`: the
    plan's)."""
    if not plan.late_grammar_rows:
        return None
    late = plan.late_grammar_rows
    masks, draft_rows = grammar_masks(plan, rows, late, num_nodes)
    return LateGrammar(plan.step_id, late, masks, draft_rows)


def grammar_masks(plan: StepPlan, rows: list[Request], indices: list[int], num_nodes: int):
    """-> the bitmasks of rows[indices] [n, num_nodes, W] and what the ranks' draft grammars
    need (workers/draft_grammar.py; none without drafts)."""
    width = rows[indices[0]].grammar.width
    masks = torch.empty(len(indices), num_nodes, width, dtype=torch.int32)
    for n, i in enumerate(indices):
        rows[i].grammar.fill(masks[n], *rows[i].drafts)
    if num_nodes == 1:
        return masks.numpy(), []
    admitted = [i < len(plan.prefills) and not plan.prefills[i].is_continued for i in indices]
    draft_rows = (rows[i].draft_grammar_row(a) for i, a in zip(indices, admitted))
    return masks.numpy(), [d for d in draft_rows if d is not None]


def follow_grammar(r: Request, tokens: list[int], result: StepResult, row: int) -> bool:
    """r's grammar takes its new tokens and its new drafts. -> False where a token left it."""
    if result.drafts is not None:
        siblings = result.siblings[row].tolist() if result.siblings is not None else []
        r.drafts = (result.drafts[row].tolist(), siblings)
    return r.grammar.accept(tokens)
