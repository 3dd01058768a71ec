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
    saved = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostSyncError(f"Tensor.{name}() inside a speculative step forces a host sync")

        return method

    for name in _PATCHED:
        setattr(torch.Tensor, name, refuse(name))
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def allow_host_sync():
    """Inside a guarded step, the one place that must sync (workers/draft_grammar.py: drafts that
    follow a grammar, in steps with constrained rows only) does so here."""
    patched = {name: getattr(torch.Tensor, name) for name in _PATCHED}
    if patched == _ORIGINAL:  # not inside a guarded step
        yield
        return
    for name, method in _ORIGINAL.items():
        setattr(torch.Tensor, name, method)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        for name, method in patched.items():
            setattr(torch.Tensor, name, method)
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
