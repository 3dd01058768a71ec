"""Eagle3 hidden-state resource manager: one per worker, preallocated at start, fixed addresses
(CUDA graphs capture them). It holds the target's captured auxiliary features for the rows of the
current step and, per request slot, the drafter's last hidden state. Slots follow the request
lifecycle under one owner (the coordinator's plan); touching a freed slot is an error."""

import torch


class SlotError(RuntimeError):
    pass


class Eagle3ResourceManager:
    def __init__(
        self,
        num_slots: int,
        max_step_tokens: int,
        feature_dim: int,
        hidden_size: int,
        dtype: torch.dtype,
        device,
    ):
        self.num_slots = num_slots
        self.dummy_slot = num_slots  # padding rows of a batch point here
        self.features = torch.zeros(
            max_step_tokens, feature_dim, dtype=dtype, device=device
        )  # [tokens, 3H]
        self.draft_hidden = torch.zeros(
            num_slots + 1, hidden_size, dtype=dtype, device=device
        )  # [slots+1, H]
        self.is_allocated = [False] * num_slots

    @property
    def nbytes(self) -> int:
        return self.features.nbytes + self.draft_hidden.nbytes

    def allocate(self, slot: int) -> None:
        self._check_range(slot)
        if self.is_allocated[slot]:
            raise SlotError(f"slot {slot} is already allocated")
        self.is_allocated[slot] = True

    def free(self, slot: int) -> None:
        self._check_range(slot)
        if not self.is_allocated[slot]:
            raise SlotError(f"double free of slot {slot}")
        self.is_allocated[slot] = False

    def check_allocated(self, slots: list[int]) -> None:
        for slot in slots:
            self._check_range(slot)
            if not self.is_allocated[slot]:
                raise SlotError(f"slot {slot} is read but not allocated (freed or never taken)")

    def _check_range(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} outside 0..{self.num_slots - 1}")

    def feature_view(self, rows: int, tokens: int) -> torch.Tensor:
        """Where the target writes this step's aux features: [rows, tokens, 3H]."""
        if rows * tokens > self.features.shape[0]:
            raise SlotError(
                f"step of {rows}x{tokens} tokens exceeds the feature buffer "
                f"({self.features.shape[0]} tokens)"
            )
        return self.features[: rows * tokens].view(rows, tokens, self.features.shape[1])

    def write_hidden(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        self.draft_hidden.index_copy_(0, slots, hidden)  # async on the current stream

    def read_hidden(self, slots: torch.Tensor) -> torch.Tensor:
        return self.draft_hidden.index_select(0, slots)
