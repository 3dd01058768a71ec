"""A guard that makes any host synchronisation inside a speculative step fail loudly.

On CPU there is no stream to sync, so the guard patches the tensor methods that would force one
on a GPU (`.item()`, `.cpu()`, `.tolist()`, `.numpy()`, truth tests). On CUDA it also turns on
`torch.cuda.set_sync_debug_mode("error")`."""

import contextlib

import torch


class HostSyncError(RuntimeError):
    pass


_PATCHED = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__")
_ORIGINAL = {name: getattr(torch.Tensor, name) for name in _PATCHED}


@contextlib.contextmanager
def no_host_sync(enabled: bool = True):
    if not enabled:
        yield
        return

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostSyncError(f"Tensor.{name}() inside a speculative step forces a host sync")

        return method

    with _tensor_methods({name: refuse(name) for name in _PATCHED}, "error"):
        yield


@contextlib.contextmanager
def allow_host_sync():
    """Inside a guarded step, the one place that must sync (workers/draft_grammar.py: drafts that
    follow a grammar, in steps with constrained rows only) does so here."""
    if {name: getattr(torch.Tensor, name) for name in _PATCHED} == _ORIGINAL:  # not guarded
        yield
        return
    with _tensor_methods(_ORIGINAL, "default"):
        yield


@contextlib.contextmanager
def _tensor_methods(methods: dict, sync_debug_mode: str):
    """torch.Tensor's `methods` and, on CUDA, this sync debug mode, until the block ends."""
    saved = {name: getattr(torch.Tensor, name) for name in methods}
    for name, method in methods.items():
        setattr(torch.Tensor, name, method)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(sync_debug_mode)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
