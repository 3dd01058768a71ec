"""The scheduler's side of the paged KV pool (block_manager.py): a request's blocks.

How many blocks a request needs for a step, growing its block list (and the plan's block-table
updates), the prefix cache's blocks at admission, giving blocks back, and each step's reservation:
blocks for every row the step writes, oldest request first; where the pool runs out, a request
gives all its blocks back (recompute: it is prefilled again later): the newest under fcfs, the
one of largest (priority, arrival) under the priority policy."""

from speculative.engine.block_manager import BlockManager


class RequestBlocks:
    """The scheduler's side of the pool: how many blocks a request needs for a step, growing
    its block list (and the plan's block-table updates) and giving blocks back."""

    def __init__(
        self, manager: BlockManager, k: int, tree_rows: int, max_model_len: int, policy="fcfs"
    ):
        self.manager, self.k, self.tree_rows = manager, k, tree_rows
        self.policy = policy  # the scheduling policy, which picks whom to preempt
        # the worker's per-request cache length (workers/model_runner.py): the last token's
        # K+1 past it, twice (a step in flight may overrun a finished request), the tree's rows
        self.max_blocks = manager.blocks_for(max_model_len + 2 * (k + 1) + tree_rows + 1)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens (prompt + max_tokens) fits the whole pool."""
        return self.needed(num_tokens, in_flight=2) <= self.manager.num_blocks

    def needed(self, num_tokens: int, in_flight: int) -> int:
        """Blocks for every row a step may write: past the num_tokens known on the host, K+1
        for each step in flight (this one included), the draft chain's K+1 and the tree's."""
        span = num_tokens + in_flight * (self.k + 1) + self.k + 1 + self.tree_rows
        return min(self.manager.blocks_for(span), self.max_blocks)

    def missing(self, r, in_flight: int) -> int:
        return max(0, self.needed(len(r.prompt_ids) + len(r.output_ids), in_flight) - len(r.blocks))

    def grow(self, r, num_new: int, updates: list) -> None:
        """Append num_new free blocks to r's (the caller checked they are free)."""
        for _ in range(num_new):
            updates.append((r.slot, len(r.blocks), self.manager.allocate()))
            r.blocks.append(updates[-1][2])

    def match(self, r, tokens: list[int], may_match: bool) -> int:
        """A new prefill of `tokens`: r holds the cached blocks of its prefix (where may_match;
        the last token is always computed, for its logits). -> the tokens found cached."""
        cached, hashes = self.manager.match(tokens, len(tokens) - 1) if may_match else ([], [])
        r.blocks, r.block_hashes = cached, hashes
        return len(cached) * self.manager.block_size

    def admit(self, r, num_tokens: int, num_queried: int, updates: list) -> bool:
        """After `match`: blocks for r's first num_tokens, or False (the match let go) if the
        pool has too few free. num_queried: the tokens looked up (0: not looked up)."""
        manager, cached = self.manager, r.blocks
        num_new = self.needed(num_tokens, in_flight=1) - len(cached)
        if num_new > manager.num_free:
            manager.release(cached)
            r.blocks, r.block_hashes = [], []
            return False
        manager.stats.num_queried_tokens += num_queried
        manager.stats.num_hit_tokens += len(cached) * manager.block_size if num_queried else 0
        updates.extend((r.slot, i, block) for i, block in enumerate(cached))
        self.grow(r, num_new, updates)
        return True

    def confirm(self, r) -> None:
        """Cache r's full blocks whose K/V is computed, by steps whose results are in: its
        prefill chunks so far, or once prefilled, every token before the pending one."""
        if not r.blocks:
            return
        if r.num_confirmed < len(r.prefill_ids):
            tokens = r.prefill_ids[: r.num_confirmed]
        else:
            tokens = r.prompt_ids + r.output_ids[:-1]
        self.manager.cache(r.blocks, r.block_hashes, tokens)

    def free(self, r) -> None:
        self.confirm(r)
        self.manager.release(r.blocks)
        r.blocks, r.block_hashes = [], []

    def reserve(self, running: dict, decodes: list, chunks: dict) -> tuple:
        """Blocks for the rows the next step writes (decodes, and prefill chunks {request id:
        chunk end}), oldest request first; where the pool runs out, a running request that holds
        blocks gives them all back (`_preempt_one`; it is recomputed from its tokens later). The
        preempted stay in `running` here: the scheduler requeues them. -> (the decodes and chunks
        not preempted, the block-table updates, the preempted, in the order they were taken)."""
        updates, preempted = [], []
        decode_ids = {r.request_id for r in decodes}
        rows = [r for r in running.values() if r.request_id in decode_ids or r.request_id in chunks]
        for r in rows:  # a row preempted by an older row's reservation stays preempted
            if r.is_preempted:
                continue
            if r.request_id in decode_ids:
                missing = self.missing(r, r.in_flight + 1)
            else:
                missing = max(0, self.needed(chunks[r.request_id], 1) - len(r.blocks))
            while missing > self.manager.num_free and not r.is_preempted:
                preempted.append(self._preempt_one(running))
            if not r.is_preempted:
                self.grow(r, missing, updates)
        decodes = [r for r in decodes if not r.is_preempted]
        chunks = {i: end for i, end in chunks.items() if not running[i].is_preempted}
        return decodes, chunks, updates, preempted

    def _preempt_one(self, running: dict):
        """Of the running requests that hold blocks and go on (a finished one's come back once
        its last step is processed), the most recently admitted (fcfs) or the one of largest
        (priority, arrival) (priority, as vLLM's) gives them back. -> that request."""
        holders = [v for v in running.values() if v.blocks and not v.is_finished]
        if self.policy == "priority":
            r = max(holders, key=lambda v: v.priority_key)
        else:
            r = holders[-1]
        self.free(r)
        r.is_preempted = True
        return r
